"""The measurement engine under its old name: ``amp_lessons.measure`` re-exports
``amp_lessons.bench`` (the notebooks and learners' code call ``al.measure.run_configs`` etc.).
New code imports ``amp_lessons.bench``; nothing is defined here."""
from .bench import *  # noqa: F401,F403
from .bench import __all__  # noqa: F401
