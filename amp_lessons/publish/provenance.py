"""What produced a published table, and how to ask (``python -m amp_lessons explain KEY``).

``amp_lessons.lessons.PUBLISHED`` maps every key a notebook publishes (``report.publish``) to the
chain of functions from the lesson function that built the table down to the code that measured
it (the timer for a timed table). ``report.publish`` stores ``record(key)`` inside the published bundle: that chain
with each function's module, file and line, the device, the torch version and the
configurations of the rows; the notebook's run record says which run. ``explain`` prints it.
"""
from __future__ import annotations

import importlib
import inspect
import platform
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch

MEASURED: Dict[str, Dict[str, object]] = {}  # label -> configuration, of every measured row


def remember(label: str, config: Mapping[str, object]) -> None:
    """Note that a row labelled ``label`` was measured with ``config`` (``runner.measure`` calls
    this), so a table published later that names the label records its configuration."""
    if not isinstance(label, str) or not isinstance(config, Mapping):
        raise ValueError(f"label must be a string and config a mapping; got {label!r}, {config!r}")
    MEASURED[label] = dict(config)


def producers(key: str) -> Sequence[str]:
    """The functions (dotted names, outermost first) that produce the table published as
    ``key``; a ``ValueError`` names the known keys for a key no notebook publishes."""
    if not isinstance(key, str):
        raise ValueError(f"key must be a string; got {key!r}")
    from amp_lessons.lessons import PUBLISHED

    if key in PUBLISHED and not key.endswith("."):
        return PUBLISHED[key]
    keys = published_keys()
    if key in keys:  # a key under a prefix (claims.l01: the verdicts of lesson 01)
        return next(chain for prefix, chain in PUBLISHED.items()
                    if prefix.endswith(".") and key.startswith(prefix))
    raise ValueError(f"key must be a published table's key ({', '.join(keys)}); got {key!r}")


def published_keys() -> List[str]:
    """Every key a lesson can publish, sorted: the registry's (``lessons.PUBLISHED``), with its
    prefix ``claims.`` written out as the lessons whose claims are decided (``claims.l01``...):
    the prefix alone is not a key, and ``claims.l99`` is none."""
    from amp_lessons.publish.claims import CLAIMS
    from amp_lessons.lessons import PUBLISHED
    from amp_lessons.publish.report import VERDICT_PREFIX

    keys = {k for k in PUBLISHED if not k.endswith(".")}
    keys.update(f"{VERDICT_PREFIX}l{c.lesson}" for c in CLAIMS.values() if c.lesson)
    return sorted(keys)


def locate(dotted: str) -> Dict[str, object]:
    """Where a function lives: ``{"function", "module", "file", "line"}`` (file relative to the
    package's parent folder). A name that does not resolve raises ``ValueError``."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        obj = inspect.unwrap(obj)
        try:
            file = Path(inspect.getsourcefile(obj)).resolve()
            _, line = inspect.getsourcelines(obj)
        except (TypeError, OSError) as exc:
            raise ValueError(f"{dotted} has no source to point at ({exc})") from None
        root = Path(__file__).resolve().parents[2]
        try:
            file = file.relative_to(root)
        except ValueError:
            pass
        return {"function": parts[-1] if cut == len(parts) - 1 else ".".join(parts[cut:]),
                "module": ".".join(parts[:cut]), "file": str(file), "line": line}
    raise ValueError(f"{dotted} does not name a function of the course's package")


def record(key: str, rows: Sequence[Mapping] = (), device: Optional[str] = None) -> Dict[str, object]:
    """What ``report.publish`` stores beside a table: the producing functions (module, file,
    line), the configurations of the rows (a row's own ``config``, or the configuration measured
    under a label the row names, ``remember``), device and torch version."""
    try:
        chain = [locate(name) for name in producers(key)]
        missing = ""
    except ValueError as exc:  # a table no lesson declares: kept, and said so
        chain, missing = [], str(exc)
    configs: List[Dict[str, object]] = []
    for r in rows:
        if not isinstance(r, Mapping):
            continue
        found = [dict(r["config"])] if isinstance(r.get("config"), Mapping) else \
            [MEASURED[v] for v in r.values() if isinstance(v, str) and v in MEASURED]
        configs += [c for c in found if c not in configs]
    if device is None:
        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else platform.processor() or platform.machine() or "CPU")
    out = {"produced_by": chain, "configurations": configs, "device": device,
           "torch": torch.__version__, "cuda": torch.version.cuda}
    if missing:
        out["unexplained"] = missing
    return out


def explain(key: str, published: Optional[Mapping] = None) -> str:
    """The path from the published table ``key`` to the code that measured it, as text: the
    functions with file and line (from this checkout), and from the published bundle
    (``published``, as ``report.collect`` returns it) the configurations, device, torch and run."""
    lines = [f"{key}: {published.get('title', '')}" if published else f"{key}:",
             "produced by (outermost first):"]
    for where in (locate(name) for name in producers(key)):
        lines.append(f"  {where['module']}.{where['function']}  {where['file']}:{where['line']}")
    if published is None:
        lines.append("no executed notebook in this checkout publishes it yet")
        return "\n".join(lines)
    prov = published.get("provenance") or {}
    run = published.get("run") or {}
    lines.append(f"notebook: {published.get('notebook', '?')}")
    lines.append(f"run: " + (", ".join(f"{k}={v}" for k, v in run.items() if not isinstance(v, (dict, list)))
                             or "no run record"))
    if prov:
        lines.append(f"device: {prov.get('device')}; torch {prov.get('torch')} (CUDA {prov.get('cuda')})")
        for cfg in prov.get("configurations", []):
            lines.append("  configuration: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    else:
        lines.append("the published bundle predates provenance records: re-run the notebook")
    return "\n".join(lines)
