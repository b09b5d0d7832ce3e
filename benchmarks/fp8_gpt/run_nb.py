"""Execute one lesson notebook on the GPU machine as ``python -m amp_lessons run-notebooks`` does
(same client, same run record in the metadata), but write the executed copy to OUT after every
cell, so a run stopped by the machine's time limit still brings back what it ran.

    python3 benchmarks/fp8_gpt/run_nb.py notebooks/10_fp8_end_to_end.ipynb $OUT
"""
import os
import sys
import time
from pathlib import Path

from nbclient import NotebookClient

from amp_lessons.files import read_notebook, write_notebook
from amp_lessons.publish.notebooks import GPU_TAG, run_record


def main(path: str, out: str, profile: str = "full") -> int:
    path, target = Path(path), Path(out) / Path(path).name
    os.environ["AMP_LESSONS_PROFILE"] = profile
    nb = read_notebook(path)
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    started = time.perf_counter()
    failed = None
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            t0 = time.perf_counter()
            try:
                client.execute_cell(cell, index)
            except Exception as exc:  # noqa: BLE001 - write what ran, then say which cell failed
                failed = f"cell {index}: {type(exc).__name__}: {str(exc)[-3000:]}"
            print(f"cell {index}: {time.perf_counter() - t0:.1f} s", flush=True)
            write_notebook(nb, target)
            if failed:
                break
    record = run_record(profile)
    record["seconds"] = round(time.perf_counter() - started, 1)
    nb.metadata.setdefault("amp_lessons", {})["run"] = record
    write_notebook(nb, target)
    print(failed or f"ok in {record['seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
