"""Repository-wide pytest hooks: nbval cells tagged ``requires-gpu`` are skipped without CUDA."""
import pytest

GPU_TAG = "requires-gpu"


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="cell is tagged requires-gpu and no CUDA device is present")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's IPyNbCell
        if cell is not None and GPU_TAG in cell.get("metadata", {}).get("tags", []):
            item.add_marker(skip)
