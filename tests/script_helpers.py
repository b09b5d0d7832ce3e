"""Import a script of ``benchmarks/`` by its path, for its tests (the scripts are not a package)."""
import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py``, freshly executed (a test may patch it freely)."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"name must be a script in benchmarks/; no {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
