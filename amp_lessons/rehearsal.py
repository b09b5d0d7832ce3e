"""Rehearse the course on a simulated card: every lesson's full profile under
``AMP_LESSONS_SIMULATE`` (``env.simulated_card``), with what a learner on that card would meet.

``python -m amp_lessons rehearse --card t4 --out DIR`` runs each notebook in turn with the
simulation switched on (the allocator capped at the card's memory, bf16 and TF32 treated as
unsupported, the card's compute capability reported) and writes ``DIR/rehearsal_<card>.json``:
per lesson, whether it completed, how long it took, the rows its published tables marked as not
run and why, and the peak GPU memory of the lesson's processes, sampled from ``nvidia-smi``.
The executed copies go to ``DIR`` too, so a failure can be read.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from ._validate import check_choice, check_positive
from .env import CARD_FACTS, SIMULATE_VARIABLE, SIMULATED_CARDS
from .report import RESULT_MIME
from .runner import NotebookRunError, read_notebook, run_notebook, run_record
from .tables import json_safe

MIB = 2**20


def descendants(pid: int) -> List[int]:
    """``pid`` and every process below it (children, their children...), read from ``/proc``
    (Linux); just ``[pid]`` where ``/proc`` cannot be read."""
    parents: Dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended while we looked
            continue
        # the command name (2nd field) is in parentheses and may hold spaces
        fields = stat[stat.rfind(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
    found, frontier = [pid], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _query(args: Sequence[str]) -> List[List[str]]:
    out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]


def visible_gpu_index() -> int:
    """The ``nvidia-smi`` index of the first GPU this process may use (``CUDA_VISIBLE_DEVICES``'s
    first entry when it is a number, else 0)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class GpuSampler:
    """Samples, every ``interval_s`` seconds in a thread, the GPU memory used by the processes
    under ``root_pid`` (``nvidia-smi --query-compute-apps``), the used memory of GPU ``gpu``
    above what it used when sampling began (the fallback where process ids are not visible, as in
    some containers), and the GPU's utilisation (the share of time a kernel ran), integrated into
    ``busy_s``. ``peak_mib`` and ``source`` say what was seen; ``available`` is False where
    ``nvidia-smi`` cannot be run (no GPU)."""

    def __init__(self, root_pid: int, gpu: int = 0, interval_s: float = 0.25):
        check_positive("interval_s", interval_s)
        self.root_pid, self.gpu, self.interval_s = int(root_pid), int(gpu), float(interval_s)
        self.process_peak_mib = 0.0
        self.device_peak_mib = 0.0
        self.baseline_mib: Optional[float] = None
        self.busy_s = 0.0
        self._last: Optional[float] = None
        self.available = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> None:
        """Take one sample (also what the thread does)."""
        try:
            row = _query(["-i", str(self.gpu), "--query-gpu=memory.used,utilization.gpu"])[0]
            used, utilisation = float(row[0]), float(row[1])
            apps = _query(["--query-compute-apps=pid,used_memory"])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            self.available = False
            return
        now = time.perf_counter()
        if self._last is not None:
            self.busy_s += utilisation / 100 * (now - self._last)
        self._last = now
        if self.baseline_mib is None:
            self.baseline_mib = used
        self.device_peak_mib = max(self.device_peak_mib, used - self.baseline_mib)
        mine = set(descendants(self.root_pid))
        total = sum(float(mem) for pid, mem in apps if pid.isdigit() and int(pid) in mine)
        self.process_peak_mib = max(self.process_peak_mib, total)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if not self.available:
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "GpuSampler":
        self.sample()  # the baseline, before the lesson starts
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def peak_mib(self) -> Optional[float]:
        """The peak seen: per process where ``nvidia-smi`` showed the lesson's processes, else the
        GPU's growth over its baseline; None without ``nvidia-smi``."""
        if not self.available and self.baseline_mib is None:
            return None
        return self.process_peak_mib or self.device_peak_mib

    @property
    def source(self) -> str:
        """Where ``peak_mib`` comes from, in words."""
        if self.peak_mib is None:
            return "not measured: nvidia-smi could not be run (no GPU)"
        if self.process_peak_mib:
            return "nvidia-smi, the lesson's processes (CUDA contexts included)"
        return (f"nvidia-smi, GPU {self.gpu}'s used memory above its level before the lesson "
                f"(process ids not visible here)")


def not_run_rows(nb) -> List[Dict[str, str]]:
    """The rows of an executed notebook's published tables (``report.publish``) that were not
    measured: a ``status`` other than ``ok`` (``"skipped: why"``, ``"error: why"``...). One dict
    per row: ``table`` (the publish key), ``row`` (its first cell) and ``status``."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            payload = out.get("data", {}).get(RESULT_MIME)
            if not payload:
                continue
            for row in payload.get("rows", []):
                status = row.get("status")
                if status is None or str(status).strip().lower() in ("ok", ""):
                    continue
                label = next((row[k] for k in _LABEL_KEYS if row.get(k) not in (None, "")),
                             next((v for v in row.values() if isinstance(v, str) and v), "?"))
                found.append({"table": payload.get("key", "?"), "row": str(label),
                              "status": str(status)})
    return found


_LABEL_KEYS = ("technique", "configuration", "label", "recipe", "precision", "run", "name")


@contextmanager
def _simulating(card: str) -> Iterator[None]:
    old = os.environ.get(SIMULATE_VARIABLE)
    os.environ[SIMULATE_VARIABLE] = card
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SIMULATE_VARIABLE, None)
        else:
            os.environ[SIMULATE_VARIABLE] = old


def rehearse_notebook(path: Path, card: str, out: Path, profile: str = "full",
                      timeout: int = 1800) -> Dict[str, object]:
    """Run one notebook under the simulated ``card`` and return its record: ``notebook``,
    ``completed``, ``error`` (the failing cell, in one line), ``seconds``, ``peak_gpu_mib``,
    ``memory_source``, ``fits_card`` (the peak against the card's memory), ``gpu_busy_s`` (the
    seconds a kernel ran, from ``nvidia-smi``'s utilisation), ``estimated_seconds_on_card``
    (``estimated_seconds``) and ``not_run`` (``not_run_rows`` of the executed copy)."""
    check_choice("card", card, SIMULATED_CARDS)
    path, out = Path(path), Path(out)
    record: Dict[str, object] = {"notebook": path.name, "completed": False, "error": None}
    started = time.perf_counter()
    with _simulating(card), GpuSampler(os.getpid(), gpu=visible_gpu_index()) as memory:
        try:
            run_notebook(path, profile=profile, out=out, timeout=timeout, progress=False)
            record["completed"] = True
        except NotebookRunError as exc:
            record["error"] = exc.summary
        except (OSError, RuntimeError, ValueError) as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["gpu_busy_s"] = round(memory.busy_s, 1) if memory.available else None
    record["estimated_seconds_on_card"] = estimated_seconds(record["seconds"],
                                                            record["gpu_busy_s"], card)
    peak = memory.peak_mib
    record["peak_gpu_mib"] = None if peak is None else round(peak)
    record["memory_source"] = memory.source
    limit_mib = CARD_FACTS[card]["memory_gib"] * 1024
    record["fits_card"] = None if peak is None else bool(peak <= limit_mib + _CONTEXT_ALLOWANCE_MIB)
    executed = out / path.name
    record["not_run"] = not_run_rows(read_notebook(executed)) if executed.is_file() else []
    return record


# Published peak figures (vendor datasheets) of the simulated card against the GPU the rehearsal
# runs on: fp16 tensor-core arithmetic (dense) and memory bandwidth. Both put a T4 about 15x below
# an H200, so GPU-bound time is scaled by the smaller of the two ratios.
PUBLISHED = {"t4": {"card": "Tesla T4", "fp16_tensor_tflops": 65.0, "memory_gb_s": 320.0},
             "host": {"card": "NVIDIA H200", "fp16_tensor_tflops": 989.0, "memory_gb_s": 4800.0}}


def slowdown(card: str) -> float:
    """How many times longer GPU-bound work takes on ``card`` than on the H200 the rehearsal runs
    on, from ``PUBLISHED`` (the smaller of the arithmetic and the bandwidth ratio)."""
    check_choice("card", card, SIMULATED_CARDS)
    mine, host = PUBLISHED[card], PUBLISHED["host"]
    return min(host["fp16_tensor_tflops"] / mine["fp16_tensor_tflops"],
               host["memory_gb_s"] / mine["memory_gb_s"])


def estimated_seconds(seconds: float, gpu_busy_s: Optional[float], card: str) -> Optional[float]:
    """A lesson's expected run time on ``card``: the host's share of the rehearsal as it was
    (``seconds - gpu_busy_s``) plus the GPU-busy share times ``slowdown(card)``. None where the
    busy time was not measured. Colab's and Kaggle's CPUs are slower than the rehearsal host's,
    so treat it as a lower bound for host-bound lessons."""
    check_positive("seconds", seconds)
    if gpu_busy_s is None:
        return None
    busy = min(max(float(gpu_busy_s), 0.0), float(seconds))
    return round(seconds - busy + busy * slowdown(card), 1)


# The allocator is capped at the card's usable memory; nvidia-smi also counts each process's CUDA
# context (a few hundred MiB), which the card's total holds on top of that.
_CONTEXT_ALLOWANCE_MIB = 512


def rehearse(paths: Sequence[Path], card: str = "t4", out: Path = Path("rehearsal"),
             profile: str = "full", timeout: int = 1800) -> Dict[str, object]:
    """Rehearse ``paths`` in order on the simulated ``card`` and write
    ``out/rehearsal_<card>.json`` (the run's device, torch and date, the card's facts, and one
    ``rehearse_notebook`` record per lesson). A lesson that fails is recorded and the next one
    still runs. Returns the document written."""
    check_choice("card", card, SIMULATED_CARDS)
    if not paths:
        raise ValueError("paths must name at least one notebook")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    facts = CARD_FACTS[card]
    doc: Dict[str, object] = {
        "card": card, "card_facts": {"name": facts["name"], "capability": list(facts["capability"]),
                                     "memory_gib": facts["memory_gib"]},
        "host": run_record(profile), "published": PUBLISHED, "slowdown": slowdown(card),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "lessons": []}
    target = out / f"rehearsal_{card}.json"
    for path in paths:
        doc["lessons"].append(rehearse_notebook(Path(path), card, out, profile, timeout))
        target.write_text(json.dumps(json_safe(doc), indent=1))  # kept after every lesson
    return doc


def merge(docs: Sequence[Dict[str, object]], replace: bool = False) -> Dict[str, object]:
    """One rehearsal document from several (parts run on different GPUs or calls): the first
    one's card and facts, every part's host record under ``parts``, the lessons in course order.
    With ``replace`` a later part's record of a lesson replaces an earlier one (a lesson
    rehearsed again); without it a lesson named twice is an error. Raises ValueError when the
    parts simulated different cards."""
    if not docs:
        raise ValueError("docs must hold at least one rehearsal document")
    cards = {d["card"] for d in docs}
    if len(cards) != 1:
        raise ValueError(f"the parts simulate different cards: {sorted(cards)}")
    by_name: Dict[str, Dict[str, object]] = {}
    for d in docs:
        for r in d["lessons"]:
            if r["notebook"] in by_name and not replace:
                raise ValueError(f"a lesson appears in more than one part: {r['notebook']}")
            by_name[r["notebook"]] = r
    lessons = list(by_name.values())
    first = docs[0]
    parts = []
    for d in docs:  # a merged document's parts stay parts
        parts += d.get("parts") or [{"host": d.get("host"), "date": d.get("date"),
                                     "lessons": [r["notebook"] for r in d["lessons"]]}]
    return {"card": first["card"], "card_facts": first["card_facts"],
            "published": first.get("published", PUBLISHED), "slowdown": first.get("slowdown"),
            "parts": parts,
            "lessons": sorted(lessons, key=lambda r: r["notebook"])}


README_START = "<!-- rehearsal:start (python -m amp_lessons readme writes this block) -->"
README_END = "<!-- rehearsal:end -->"


def _grouped(rows: Sequence[Dict[str, str]]) -> str:
    """Rows not run, grouped by their status: "a, b: skipped: why; c: error: ..." ("none")."""
    by_status: Dict[str, List[str]] = {}
    for x in rows:
        names = by_status.setdefault(x["status"], [])
        if x["row"] not in names:
            names.append(x["row"])
    return "; ".join(f"{', '.join(names)}: {status}" for status, names in by_status.items()) or "none"


def markdown(doc: Dict[str, object]) -> str:
    """The rehearsal as a README table: per lesson, whether it completed on the simulated card,
    its time there, its GPU-busy time, the estimated time on the real card, its peak memory, and
    the rows it could not run; then where the estimate comes from."""
    facts = doc["card_facts"]
    lines = [f"| lesson | completed | time on the H200 as a {facts['name']} | GPU busy | "
             f"expected on a {facts['name']} | peak GPU memory | rows not run |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in doc["lessons"]:
        est = r.get("estimated_seconds_on_card")
        peak = r.get("peak_gpu_mib")
        not_run = _grouped(r.get("not_run", []))
        lines.append("| " + " | ".join([
            r["notebook"].split("_")[0],
            "yes" if r["completed"] else f"no: {r.get('error')}",
            f"{r['seconds'] / 60:.1f} min",
            "-" if r.get("gpu_busy_s") is None else f"{r['gpu_busy_s'] / 60:.1f} min",
            "-" if est is None else f"about {max(1, round(est / 60))} min",
            "-" if peak is None else f"{peak / 1024:.1f} GiB",
            not_run.replace("|", "/")]) + " |")
    pub = doc.get("published", PUBLISHED)
    card, host = pub[doc["card"]], pub["host"]
    lines.append("")
    lines.append(
        f"Expected time = the rehearsal's host time as it was + its GPU-busy time (from "
        f"`nvidia-smi`'s utilisation) x {doc.get('slowdown') or slowdown(doc['card']):.1f}, the "
        f"smaller of two published ratios: fp16 tensor-core arithmetic {host['fp16_tensor_tflops']:g} "
        f"against {card['fp16_tensor_tflops']:g} TFLOPS and memory bandwidth "
        f"{host['memory_gb_s']:g} against {card['memory_gb_s']:g} GB/s ({host['card']} against "
        f"{card['card']}). Colab's and Kaggle's CPUs are slower than the rehearsal host's, so the "
        f"host-bound lessons take longer there. Peak memory: {doc['lessons'][0].get('memory_source', '')}; "
        f"the allocator was capped at {facts['memory_gib']:g} GiB.")
    return "\n".join(lines)


def update_readme(readme: Path, doc: Dict[str, object]) -> bool:
    """Rewrite the README's rehearsal block (between ``README_START`` and ``README_END``) from
    ``doc``; True when the file changed. ValueError when the markers are missing."""
    text = Path(readme).read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} lacks the rehearsal markers {README_START!r} ... {README_END!r}")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    new = head + README_START + "\n" + markdown(doc) + "\n" + README_END + tail
    if new != text:
        Path(readme).write_text(new)
    return new != text
