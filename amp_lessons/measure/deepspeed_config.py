"""What the installed DeepSpeed's config does with given config dicts, run on the CPU in a
separate process (DeepSpeed is never imported into the caller: importing it loads its
accelerator and op-builder code). ``deepspeed_config_check`` builds
``deepspeed.runtime.config.DeepSpeedConfig`` from each dict and reports whether it was accepted
or the error it raised.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict, Mapping, Optional, Sequence

from amp_lessons.validate import check_positive

_PROBE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
out = {"version": getattr(deepspeed, "__version__", None), "results": {}}
for name, cfg in json.loads(sys.argv[1]).items():
    try:
        DeepSpeedConfig(cfg)
        out["results"][name] = {"accepted": True, "error": ""}
    except Exception as exc:
        out["results"][name] = {"accepted": False,
                                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
print("DEEPSPEED-PROBE " + json.dumps(out))
"""


def deepspeed_installed(paths: Sequence[str] = ()) -> bool:
    """Whether ``deepspeed`` can be found (on ``sys.path`` plus ``paths``), without importing it."""
    old = list(sys.path)
    try:
        sys.path[:0] = list(paths)
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = old


def deepspeed_config_check(configs: Mapping[str, Mapping[str, Any]], timeout: float = 300,
                           paths: Sequence[str] = (), python: Optional[str] = None
                           ) -> Dict[str, Any]:
    """Build DeepSpeed's ``DeepSpeedConfig`` from each of ``configs`` (name -> config dict) in a
    separate CPU process (``CUDA_VISIBLE_DEVICES`` empty; ``paths`` prepended to its
    ``PYTHONPATH``). Returns ``installed``, ``version``, ``results`` (name -> ``accepted``,
    ``error``) and ``why`` (what went wrong, ``""`` when the check ran)."""
    check_positive("timeout", timeout)
    if not configs:
        raise ValueError("configs must name at least one DeepSpeed config dict")
    out: Dict[str, Any] = {"installed": deepspeed_installed(paths), "version": None,
                           "results": {}, "why": ""}
    if not out["installed"]:
        out["why"] = "deepspeed is not installed"
        return out
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(list(paths) + [os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([python or sys.executable, "-c", _PROBE, json.dumps(configs)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        out["why"] = f"importing deepspeed took more than {timeout:g} s"
        return out
    line = next((x for x in done.stdout.splitlines() if x.startswith("DEEPSPEED-PROBE ")), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        out["why"] = f"the check failed (exit {done.returncode}): {tail}"
        return out
    out.update(json.loads(line[len("DEEPSPEED-PROBE "):]))
    return out
