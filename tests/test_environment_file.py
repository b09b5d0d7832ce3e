"""environment.yml installs the same packages as pyproject.toml (runtime, lab and test extras)."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ @]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_names() -> set:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        names |= {_name(r) for r in extra}
    return names


def _environment_names() -> set:
    names = set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s*-\s+([A-Za-z0-9_.\-]+[^#]*)$", line)
        if not m or line.strip().startswith("- -e") or line.strip().endswith(":"):
            continue
        item = m.group(1).strip()
        if item.startswith(("python", "pip")) and _name(item) in ("python", "pip"):
            continue
        names.add(_name(item))
    names.discard("conda-forge")
    return names


def test_environment_names_the_same_packages():
    assert _environment_names() == _pyproject_names()


def test_constraints_pin_the_tested_torch():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    assert _pyproject_names() - {"amp-lessons"} <= {k.lower() for k in pins}


def test_readme_states_the_python_that_pyproject_requires():
    import sys

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = tuple(int(x) for x in spec.removeprefix(">=").split("."))
    readme = (ROOT / "README.md").read_text()
    assert f"Python {low[0]}.{low[1]} or newer" in readme
    assert "3.9+" not in readme
    assert sys.version_info[:2] >= low, "this interpreter is older than pyproject's requires-python"
