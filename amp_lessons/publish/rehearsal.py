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
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from amp_lessons.validate import check_choice, check_positive, check_real, is_real
from amp_lessons.env import CARD_FACTS, SIMULATE_VARIABLE, SIMULATED_CARDS
from amp_lessons.files import read_json, read_text, write_atomic, write_json
from amp_lessons.publish.report import RESULT_MIME, replace_block
from amp_lessons.publish.notebooks import (NotebookRunError, environment_variable, read_notebook, run_notebook,
                     run_record)
from amp_lessons.tables import json_safe, markdown_text

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


def visible_gpu() -> str:
    """How ``nvidia-smi -i`` names the first GPU this process may use: ``CUDA_VISIBLE_DEVICES``'s
    first entry (an index or a ``GPU-...`` UUID, both of which ``-i`` takes), else ``"0"``."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first or "0"


def _number(text: str) -> Optional[float]:
    """A number from an ``nvidia-smi`` field, or None for "[N/A]" and the like."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def gpu_in_use(root_pid: Optional[int] = None) -> Optional[List[Dict[str, object]]]:
    """Compute processes on the GPUs this process may use (``CUDA_VISIBLE_DEVICES``' indices or
    UUIDs, else every GPU) that are not under ``root_pid`` (default: this process): one dict per
    process with ``gpu`` (index), ``pid`` and ``used_mib``. A measurement on a GPU that another
    process also uses times both. None where ``nvidia-smi`` cannot tell (none, no GPU)."""
    try:
        gpus = _query(["--query-gpu=index,uuid"])
        apps = _query(["--query-compute-apps=pid,gpu_uuid,used_memory"])
    except Exception:  # noqa: BLE001 - no nvidia-smi, no driver, odd output
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index_of = {row[1]: row[0] for row in gpus if len(row) >= 2}
    chosen = {uuid for uuid, index in index_of.items()
              if not visible or index in visible or any(uuid.startswith(v) for v in visible
                                                         if v.startswith("GPU-"))}
    mine = set(descendants(os.getpid() if root_pid is None else int(root_pid)))
    return [{"gpu": index_of[app[1]], "pid": int(app[0]), "used_mib": _number(app[2])}
            for app in apps if len(app) >= 3 and app[1] in chosen and app[0].isdigit()
            and int(app[0]) not in mine]


def busy_gpu_text(busy: Sequence[Dict[str, object]]) -> str:
    """``gpu_in_use`` rows in one line: "GPU 0 is in use by pid 123 (2,048 MiB)"."""
    return "; ".join(f"GPU {b['gpu']} is in use by pid {b['pid']}"
                     + (f" ({b['used_mib']:,.0f} MiB)" if b.get("used_mib") is not None else "")
                     for b in busy)


def wait_for_idle_gpu(wait_s: float = 60.0, poll_s: float = 2.0) -> List[Dict[str, object]]:
    """``gpu_in_use()`` after waiting up to ``wait_s`` seconds for it to clear (a kernel that
    just finished may still be shutting its workers down); ``[]`` when the GPUs are free or
    ``nvidia-smi`` cannot tell."""
    check_positive("poll_s", poll_s)
    check_real("wait_s", wait_s, 0.0)
    deadline = time.perf_counter() + wait_s
    while True:
        busy = gpu_in_use() or []
        if not busy or time.perf_counter() >= deadline:
            return busy
        time.sleep(poll_s)


class GpuSampler:
    """Samples, every ``interval_s`` seconds in a thread, GPU ``gpu`` (an ``nvidia-smi -i`` index
    or UUID): the memory used on it by the processes under ``root_pid`` (``nvidia-smi
    --query-compute-apps``, only this GPU's), its used memory above its level when sampling began
    (the fallback where process ids are not visible, as in some containers), and its utilisation
    (the share of time a kernel ran), integrated into ``busy_s``.

    ``available`` is False where the first sample fails (no ``nvidia-smi``, no GPU). Later failed
    samples are counted in ``failed_samples`` and skipped, and fields it cannot read ("[N/A]")
    are left out; ``source`` says so. ``peak_mib`` is the peak seen."""

    def __init__(self, root_pid: int, gpu="0", interval_s: float = 0.25):
        check_positive("interval_s", interval_s)
        self.root_pid, self.gpu, self.interval_s = int(root_pid), str(gpu), float(interval_s)
        self.process_peak_mib = 0.0
        self.device_peak_mib = 0.0
        self.baseline_mib: Optional[float] = None
        self.busy_s = 0.0
        self.busy_measured = False
        self.samples = 0
        self.failed_samples = 0
        self.last_error: Optional[str] = None
        self._last: Optional[float] = None
        self.available = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> bool:
        """Take one sample (also what the thread does); False when it could not be taken."""
        try:
            row = _query(["-i", self.gpu, "--query-gpu=uuid,memory.used,utilization.gpu"])[0]
            uuid, used, utilisation = row[0], _number(row[1]), _number(row[2])
            apps = _query(["--query-compute-apps=pid,gpu_uuid,used_memory"])
            mine = set(descendants(self.root_pid))
        except Exception as exc:  # noqa: BLE001 - nvidia-smi missing, timed out, odd output
            self.failed_samples += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            if self.samples == 0:
                self.available = False
            return False
        self.samples += 1
        now = time.perf_counter()
        if utilisation is not None:
            if self._last is not None:
                self.busy_s += utilisation / 100 * (now - self._last)
                self.busy_measured = True
            self._last = now
        if used is not None:
            if self.baseline_mib is None:
                self.baseline_mib = used
            self.device_peak_mib = max(self.device_peak_mib, used - self.baseline_mib)
        total = 0.0
        for app in apps:
            if len(app) < 3 or app[1] != uuid or not app[0].isdigit() or int(app[0]) not in mine:
                continue
            total += _number(app[2]) or 0.0
        self.process_peak_mib = max(self.process_peak_mib, total)
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "GpuSampler":
        if self.sample():  # the baseline, before the lesson starts
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # at most one sample (two nvidia-smi calls) to finish
        self.sample()  # the last reading, after the lesson

    @property
    def peak_mib(self) -> Optional[float]:
        """The peak seen: per process where ``nvidia-smi`` showed the lesson's processes, else the
        GPU's growth over its baseline; None where nothing could be read."""
        if not self.available or (self.baseline_mib is None and not self.process_peak_mib):
            return None
        return self.process_peak_mib or self.device_peak_mib

    @property
    def source(self) -> str:
        """Where ``peak_mib`` comes from, in words (and how many samples failed)."""
        if self.peak_mib is None:
            return f"not measured: nvidia-smi could not be read ({self.last_error or 'no GPU'})"
        if self.process_peak_mib:
            text = "nvidia-smi, the lesson's processes on this GPU (CUDA contexts included)"
        else:
            text = (f"nvidia-smi, GPU {self.gpu}'s used memory above its level before the lesson "
                    f"(process ids not visible here)")
        if self.failed_samples:
            text += (f"; {self.failed_samples} of {self.samples + self.failed_samples} samples "
                     f"failed ({self.last_error})")
        return text


def not_run_rows(nb) -> List[Dict[str, str]]:
    """The rows of an executed notebook's published tables (``report.publish``) that were not
    measured: a ``status`` that starts with one of ``NOT_RUN`` (``"skipped: why"``, ``"error:
    why"``, ``"not measured: why"``...; ``ok`` and ``measured`` ran). One dict per row:
    ``table`` (the publish key), ``row`` (its label: ``_LABEL_KEYS``, at most two of them) and
    ``status``."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            payload = out.get("data", {}).get(RESULT_MIME)
            if not payload:
                continue
            for row in payload.get("rows", []):
                status = row.get("status")
                if status is None or not str(status).strip().lower().startswith(NOT_RUN):
                    continue
                parts = [str(row[k]) for k in _LABEL_KEYS if row.get(k) not in (None, "")][:2]
                label = " ".join(parts) or next(
                    (v for v in row.values() if isinstance(v, str) and v), "?")
                found.append({"table": payload.get("key", "?"), "row": str(label),
                              "status": str(status)})
    return found


_LABEL_KEYS = ("width", "technique", "configuration", "label", "recipe", "precision", "run",
               "name")
# How the lessons' published tables mark a row that did not run (``status``, lower case).
NOT_RUN = ("skipped", "error", "not measured", "not run", "out of memory", "failed")


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
    busy = wait_for_idle_gpu()
    if busy:  # its times and memory would be another process's too
        record.update(error=f"not run: {busy_gpu_text(busy)}",
                      seconds=round(time.perf_counter() - started, 1), gpu_busy_s=None,
                      estimated_seconds_on_card=None, peak_gpu_mib=None, not_run=[])
        return record
    with environment_variable(SIMULATE_VARIABLE, card), GpuSampler(os.getpid(), gpu=visible_gpu()) as memory:
        try:
            run_notebook(path, profile=profile, out=out, timeout=timeout, progress=False)
            record["completed"] = True
        except NotebookRunError as exc:
            record["error"] = exc.summary
        except Exception as exc:  # noqa: BLE001 - a kernel that would not start: record, go on
            record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["gpu_busy_s"] = round(memory.busy_s, 1) if memory.busy_measured else None
    record["estimated_seconds_on_card"] = estimated_seconds(record["seconds"],
                                                            record["gpu_busy_s"], card)
    peak = memory.peak_mib
    record["peak_gpu_mib"] = None if peak is None else round(peak)
    record["memory_source"] = memory.source
    # nvidia-smi counts CUDA contexts too, so the peak is held against the card's whole memory
    record["fits_card"] = None if peak is None else bool(peak <= CARD_FACTS[card]["total_gib"] * 1024)
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
    if not (is_real(seconds) and seconds >= 0):
        raise ValueError(f"seconds must be a number >= 0; got {seconds!r}")
    if gpu_busy_s is None:
        return None
    busy = min(max(float(gpu_busy_s), 0.0), float(seconds))
    return round(seconds - busy + busy * slowdown(card), 1)


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
        write_json(target, json_safe(doc), "rehearsal record")  # kept after every lesson
    return doc


def merge(docs: Sequence[Dict[str, object]], replace: bool = False) -> Dict[str, object]:
    """One rehearsal document from several (parts run on different GPUs or calls): the first
    one's card and facts, every part's host record under ``parts``, the lessons in course order.
    With ``replace`` a later part's record of a lesson replaces an earlier one (a lesson
    rehearsed again); without it a lesson named twice is an error. Raises ValueError when the
    parts simulated different cards."""
    if not docs:
        raise ValueError("docs must hold at least one rehearsal document")
    for i, d in enumerate(docs):
        check_record(d, f"docs[{i}]")
    cards = {(d["card"], json.dumps({k: (d.get("card_facts") or {}).get(k) for k in _SIMULATED},
                                    sort_keys=True)) for d in docs}
    if len(cards) != 1:
        raise ValueError(f"the parts simulate different cards (or the same card with other "
                         f"facts): {sorted(c for c, _ in cards)}")
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


def read_record(path: Path, name: str = "") -> Dict[str, object]:
    """The rehearsal record in ``path``, checked with ``check_record``. ValueError naming the
    file (or ``name``) when it is empty, truncated, not UTF-8, not JSON or not a rehearsal
    record."""
    doc = read_json(path, name or "rehearsal record")
    check_record(doc, f"{name + ': ' if name else ''}'{path}'")
    return doc


def check_record(doc, name: str = "the document") -> None:
    """ValueError naming ``name`` and the first field that is wrong, unless ``doc`` has the shape
    ``rehearse`` writes: a simulated ``card`` with its ``card_facts``, and ``lessons``, each a
    dict with its ``notebook``, ``completed``, ``seconds`` (a number >= 0) and optional numbers
    ``gpu_busy_s``, ``estimated_seconds_on_card``, ``peak_gpu_mib`` and a ``not_run`` list."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{name} is not a rehearsal record: {what}")

    if not isinstance(doc, dict):
        raise bad(f"a JSON object is needed; got {type(doc).__name__}")
    if doc.get("card") not in SIMULATED_CARDS:
        raise bad(f"card must be one of {', '.join(SIMULATED_CARDS)}; got {doc.get('card')!r}")
    facts = doc.get("card_facts")
    if not isinstance(facts, dict) or not isinstance(facts.get("name"), str) \
            or not is_real(facts.get("memory_gib")):
        raise bad("card_facts must hold the card's name and memory_gib")
    lessons = doc.get("lessons")
    if not isinstance(lessons, list):
        raise bad("lessons must be a list")
    for i, r in enumerate(lessons):
        where = f"lessons[{i}]"
        if not isinstance(r, dict) or not isinstance(r.get("notebook"), str):
            raise bad(f"{where} must be an object with a notebook name")
        if not isinstance(r.get("completed"), bool):
            raise bad(f"{where}.completed must be true or false")
        if not (is_real(r.get("seconds")) and r["seconds"] >= 0):
            raise bad(f"{where}.seconds must be a number >= 0; got {r.get('seconds')!r}")
        for key in ("gpu_busy_s", "estimated_seconds_on_card", "peak_gpu_mib"):
            if r.get(key) is not None and not (is_real(r[key]) and r[key] >= 0):
                raise bad(f"{where}.{key} must be null or a number >= 0; got {r[key]!r}")
        rows = r.get("not_run", [])
        if not isinstance(rows, list) or not all(isinstance(x, dict) and isinstance(
                x.get("row"), str) and isinstance(x.get("status"), str) for x in rows):
            raise bad(f"{where}.not_run must be a list of rows with 'row' and 'status'")


# The facts of a card that change what a rehearsal does: parts must agree on them to be merged.
_SIMULATED = ("name", "capability", "memory_gib")

README_START = "<!-- rehearsal:start (python -m amp_lessons readme writes this block) -->"
README_END = "<!-- rehearsal:end -->"


def _grouped(rows: Sequence[Dict[str, str]]) -> str:
    """Rows not run, grouped by their status: "`a`, `b`: skipped: why; `c`: error: ..." ("none")."""
    by_status: Dict[str, List[str]] = {}
    for x in rows:
        names = by_status.setdefault(x["status"], [])
        if x["row"] not in names:
            names.append(x["row"])
    def code(name: str) -> str:  # row labels hold commas: each one in its own code span
        return "`" + name.replace("`", "'") + "`"

    return "; ".join(f"{', '.join(map(code, names))}: {status}"
                     for status, names in by_status.items()) or "none"


def _sources(lessons: Sequence[Dict[str, object]]) -> str:
    """Where the peak memory came from; with more than one source, which lessons used which."""
    by_source: Dict[str, List[str]] = {}
    for r in lessons:
        by_source.setdefault(r.get("memory_source", "?"), []).append(r["notebook"].split("_")[0])
    if len(by_source) == 1:
        return next(iter(by_source))
    return "; ".join(f"{source} (lesson{'s' if len(n) > 1 else ''} {', '.join(n)})"
                     for source, n in by_source.items())


def markdown(doc: Dict[str, object], course: Sequence[str] = ()) -> str:
    """The rehearsal as a README table: per lesson, whether it completed on the simulated card,
    its time there, its GPU-busy time, the estimated time on the real card, its peak memory, and
    the rows it could not run; then where the estimate comes from. Notebooks named in ``course``
    that the record does not hold get a row saying they were not rehearsed yet, so the table
    never implies that a lesson missing from it passed."""
    check_record(doc)
    facts = doc["card_facts"]
    if not doc.get("lessons"):
        raise ValueError("the rehearsal record holds no lessons")
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
            markdown_text(not_run, in_table=True)]) + " |")
    held = {r["notebook"] for r in doc["lessons"]}
    for name in course:
        if name not in held:
            lines.append(f"| {name.split('_')[0]} | not rehearsed yet | - | - | - | - | - |")
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
        f"host-bound lessons take longer there. Peak memory: {_sources(doc['lessons'])}; "
        f"the allocator was capped at {facts['memory_gib']:g} GiB.")
    return "\n".join(lines)


def with_rehearsal(text: str, doc: Dict[str, object], name: str = "the README") -> str:
    """``text`` (a README) with its rehearsal block (between ``README_START`` and
    ``README_END``) rebuilt from ``doc``. ValueError naming ``name`` when the markers are
    missing."""
    from amp_lessons.publish.notebooks import course_notebooks  # runner imports this module: import on use
    course = [p.name for p in course_notebooks()]
    block = README_START + "\n" + markdown(doc, course) + "\n" + README_END
    return replace_block(text, README_START, README_END, block, "rehearsal", name)


def update_readme(readme: Path, doc: Dict[str, object]) -> bool:
    """Rewrite the README's rehearsal block from ``doc`` (``with_rehearsal``), atomically; True
    when the file changed. ValueError naming the file when it is not UTF-8 or the markers are
    missing."""
    text = read_text(readme, "README")
    new = with_rehearsal(text, doc, str(readme))
    if new != text:
        write_atomic(readme, new, "README")
    return new != text
