"""Each lesson's experiments, one module per notebook (``lNN_*.py``). What produced a table a
notebook publishes is recorded when it is published (``publish.provenance``), not listed here."""


def all_deciders():
    """Claim id -> the ``module.function`` that decides it (``publish.claims.deciders``), after
    importing every lesson module, so that every declaration is counted."""
    import importlib
    import pkgutil
    import re

    from amp_lessons.publish import claims
    for m in pkgutil.iter_modules(__path__):
        if re.match(r"l\d\d_", m.name):
            importlib.import_module(f"{__name__}.{m.name}")
    return claims.deciders()
