"""The T4 rehearsal (``amp_lessons.publish.rehearsal``) on the CPU: what it records, how it estimates a
T4's run time, and the CLI's errors. The GPU parts (nvidia-smi) report "not measured" here."""
import json
import os
import subprocess
import sys

import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook, new_output
import nbformat

from amp_lessons import cli
from amp_lessons import env
from amp_lessons.publish import rehearsal
from amp_lessons.publish.report import RESULT_MIME


def _notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_descendants_finds_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        found = rehearsal.descendants(os.getpid())
        assert found[0] == os.getpid() and child.pid in found
    finally:
        child.kill()
        child.wait()


def test_not_run_rows_reads_published_statuses():
    payload = {"key": "lesson04.resnet", "rows": [
        {"configuration": "fp16", "status": "ok"},
        {"configuration": "bf16", "status": "skipped: bf16 needs compute capability 8.0+"},
        {"configuration": "no status"}, {"batch": None, "technique": "AMP", "status": "error: x"},
        {"width": 4096, "recipe": "tensorwise", "status": "measured"},
        {"width": 1024, "recipe": "rowwise", "status": "not measured: capability 7.5"}]}
    cell = new_code_cell("x")
    cell.outputs = [new_output("display_data", data={RESULT_MIME: payload, "text/plain": "t"})]
    rows = rehearsal.not_run_rows(new_notebook(cells=[cell]))
    assert rows == [{"table": "lesson04.resnet", "row": "bf16",
                     "status": "skipped: bf16 needs compute capability 8.0+"},
                    {"table": "lesson04.resnet", "row": "AMP", "status": "error: x"},
                    {"table": "lesson04.resnet", "row": "1024 rowwise",
                     "status": "not measured: capability 7.5"}]


def test_slowdown_and_estimate_follow_the_published_ratios():
    ratio = rehearsal.slowdown("t4")
    assert ratio == pytest.approx(min(989 / 65, 4800 / 320))
    assert rehearsal.estimated_seconds(100.0, 10.0, "t4") == pytest.approx(90 + 10 * ratio, abs=0.1)
    assert rehearsal.estimated_seconds(100.0, 250.0, "t4") == pytest.approx(100 * ratio, abs=0.1)
    assert rehearsal.estimated_seconds(100.0, None, "t4") is None
    with pytest.raises(ValueError, match="card"):
        rehearsal.slowdown("a100")
    with pytest.raises(ValueError, match="seconds must be a number >= 0"):
        rehearsal.estimated_seconds(-1.0, 0.0, "t4")
    assert rehearsal.estimated_seconds(0.0, 0.0, "t4") == 0.0  # a lesson that failed at once


def test_sampler_without_nvidia_smi_says_not_measured(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(rehearsal.subprocess, "run", missing)
    with rehearsal.GpuSampler(os.getpid(), interval_s=0.01) as s:
        pass
    assert s.available is False and s.peak_mib is None and "not measured" in s.source
    assert s._thread is None  # no thread is started when the first sample fails
    with pytest.raises(ValueError, match="interval_s"):
        rehearsal.GpuSampler(os.getpid(), interval_s=0)


def test_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert rehearsal.visible_gpu() == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    assert rehearsal.visible_gpu() == "GPU-abc"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert rehearsal.visible_gpu() == "0"


class _FakeSmi:
    """Answers the two nvidia-smi queries the sampler makes, from a script of readings."""

    def __init__(self, readings, apps):
        self.readings, self.apps, self.calls = list(readings), apps, 0

    def __call__(self, args):
        if any(a.startswith("--query-gpu") for a in args):
            reading = self.readings[min(self.calls, len(self.readings) - 1)]
            self.calls += 1
            if isinstance(reading, Exception):
                raise reading
            return [reading]
        return self.apps


def test_sampler_counts_only_the_lessons_processes_on_its_gpu(monkeypatch):
    me, other = os.getpid(), 999999
    apps = [[str(me), "GPU-a", "700"], [str(other), "GPU-a", "5000"],  # another process
            [str(me), "GPU-b", "9000"],                                  # another GPU
            [str(me), "GPU-a", "[N/A]"], ["x"]]                          # unreadable rows
    smi = _FakeSmi([["GPU-a", "1000", "0"], ["GPU-a", "3000", "100"],
                    subprocess.TimeoutExpired("nvidia-smi", 20), ["GPU-a", "[N/A]", "50"]], apps)
    monkeypatch.setattr(rehearsal, "_query", smi)
    s = rehearsal.GpuSampler(me, gpu="0", interval_s=1.0)
    assert s.sample() and s.sample()
    assert s.sample() is False and s.available  # a later failure is counted, not fatal
    assert s.sample()
    assert s.peak_mib == 700 and s.device_peak_mib == 2000
    assert s.busy_measured and s.busy_s > 0
    assert "the lesson's processes" in s.source and "1 of 4 samples failed" in s.source


def test_sampler_falls_back_to_the_gpus_growth(monkeypatch):
    smi = _FakeSmi([["GPU-a", "1000", "0"], ["GPU-a", "4500", "0"]], apps=[])
    monkeypatch.setattr(rehearsal, "_query", smi)
    s = rehearsal.GpuSampler(os.getpid())
    s.sample()
    s.sample()
    assert s.peak_mib == 3500 and "process ids not visible" in s.source


def test_rehearse_runs_each_lesson_under_the_simulation_and_keeps_going(tmp_path, monkeypatch):
    monkeypatch.delenv(env.SIMULATE_VARIABLE, raising=False)
    good = _notebook(tmp_path / "01_good.ipynb",
                     "import os\nassert os.environ['AMP_LESSONS_SIMULATE'] == 't4'")
    bad = _notebook(tmp_path / "02_bad.ipynb", "raise RuntimeError('boom')")
    doc = rehearsal.rehearse([good, bad], card="t4", out=tmp_path / "out", profile="quick",
                             timeout=120)
    first, second = doc["lessons"]
    assert first["completed"] and first["error"] is None and first["seconds"] > 0
    assert not second["completed"] and "boom" in second["error"]
    assert os.environ.get(env.SIMULATE_VARIABLE) is None  # restored afterwards
    written = json.loads((tmp_path / "out" / "rehearsal_t4.json").read_text())
    assert [r["notebook"] for r in written["lessons"]] == ["01_good.ipynb", "02_bad.ipynb"]
    assert written["card_facts"]["memory_gib"] == env.CARD_FACTS["t4"]["memory_gib"]
    with pytest.raises(ValueError, match="at least one notebook"):
        rehearsal.rehearse([], out=tmp_path / "none")


def test_cli_rehearse_errors(tmp_path, capsys):
    assert cli.main(["rehearse", "--out", str(tmp_path), str(tmp_path / "missing.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err
    nb = _notebook(tmp_path / "01_x.ipynb", "1")
    assert cli.main(["rehearse", "--card", "a100", "--out", str(tmp_path / "o"), str(nb)]) == 2
    assert "card must be one of t4" in capsys.readouterr().err


def _doc(*lessons, card="t4"):
    return {"card": card, "card_facts": {"name": "Tesla T4", "capability": [7, 5], "memory_gib": 14.4},
            "published": rehearsal.PUBLISHED, "slowdown": rehearsal.slowdown("t4"),
            "host": {"device_name": "NVIDIA H200"}, "date": "2026-11-30",
            "lessons": [{"notebook": n, "completed": ok, "error": None if ok else "cell 3 failed",
                         "seconds": 120.0, "gpu_busy_s": 30.0,
                         "estimated_seconds_on_card": rehearsal.estimated_seconds(120.0, 30.0, "t4"),
                         "peak_gpu_mib": 9000, "memory_source": "nvidia-smi",
                         "not_run": [{"table": "t", "row": "bf16", "status": "skipped: no bf16"}]}
                        for n, ok in lessons]}


def test_merge_orders_lessons_and_refuses_overlaps():
    merged = rehearsal.merge([_doc(("04_b.ipynb", True)), _doc(("01_a.ipynb", True))])
    assert [r["notebook"] for r in merged["lessons"]] == ["01_a.ipynb", "04_b.ipynb"]
    assert [p["lessons"] for p in merged["parts"]] == [["04_b.ipynb"], ["01_a.ipynb"]]
    with pytest.raises(ValueError, match="more than one part: 01_a.ipynb"):
        rehearsal.merge([_doc(("01_a.ipynb", True)), _doc(("01_a.ipynb", True))])
    with pytest.raises(ValueError, match="at least one"):
        rehearsal.merge([])


def test_markdown_and_readme_block(tmp_path):
    doc = _doc(("01_a.ipynb", True), ("02_b.ipynb", False))
    text = rehearsal.markdown(doc)
    assert "| 01 | yes | 2.0 min | 0.5 min | about 9 min | 8.8 GiB | `bf16`: skipped: no bf16 |" in text
    assert "no: cell 3 failed" in text and "x 15.0" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rehearsal.README_START}\nold\n{rehearsal.README_END}\nend\n")
    assert rehearsal.update_readme(readme, doc) is True
    assert rehearsal.update_readme(readme, doc) is False
    body = readme.read_text()
    assert "old" not in body and body.startswith("intro\n") and body.endswith("end\n")
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="rehearsal markers"):
        rehearsal.update_readme(readme, doc)


def test_rows_not_run_are_grouped_by_status():
    rows = [{"table": "t", "row": "bf16", "status": "skipped: no bf16"},
            {"table": "t", "row": "bf16 + ckpt", "status": "skipped: no bf16"},
            {"table": "u", "row": "bf16", "status": "skipped: no bf16"},
            {"table": "t", "row": "fp8", "status": "not measured: 7.5"}]
    assert rehearsal._grouped(rows) == \
        "`bf16`, `bf16 + ckpt`: skipped: no bf16; `fp8`: not measured: 7.5"
    assert rehearsal._grouped([]) == "none"
    # labels that hold commas stay readable: each is its own code span
    assert rehearsal._grouped([{"row": "fp32, TF32 on", "status": "skipped"}]) == \
        "`fp32, TF32 on`: skipped"


def test_memory_sources_say_which_lessons_used_which():
    one = [{"notebook": "01_a.ipynb", "memory_source": "smi"},
           {"notebook": "02_b.ipynb", "memory_source": "smi"}]
    assert rehearsal._sources(one) == "smi"
    two = one + [{"notebook": "04_c.ipynb", "memory_source": "smi on this GPU"}]
    assert rehearsal._sources(two) == "smi (lessons 01, 02); smi on this GPU (lesson 04)"


def test_committed_rehearsal_covers_every_lesson_and_the_readme_shows_it():
    from pathlib import Path
    from amp_lessons.publish.notebooks import course_notebooks
    root = Path(__file__).resolve().parent.parent
    doc = json.loads((root / "docs" / "rehearsal_t4.json").read_text())
    course = [p.name for p in course_notebooks()]
    held = [r["notebook"] for r in doc["lessons"]]
    # lessons 01-07 were rehearsed; a lesson added later may wait, but the README must say so
    assert held == course[:len(held)] and len(held) >= 7
    assert doc["card"] == "t4" and all(r["seconds"] > 0 for r in doc["lessons"])
    assert all(r["peak_gpu_mib"] is not None for r in doc["lessons"])  # measured on a GPU
    table = rehearsal.markdown(doc, course)
    assert all(f"| {n.split('_')[0]} | not rehearsed yet |" in table for n in course[len(held):])
    assert table in (root / "README.md").read_text(), \
        "README's rehearsal block is stale: run `python -m amp_lessons readme`"


def test_a_course_lesson_missing_from_the_record_says_not_rehearsed():
    doc = _doc(("01_a.ipynb", True))
    table = rehearsal.markdown(doc, ["01_a.ipynb", "02_b.ipynb"])
    assert "| 02 | not rehearsed yet |" in table and "| 01 | yes |" in table
    assert "not rehearsed" not in rehearsal.markdown(doc)


def test_merge_with_replace_keeps_the_newer_record_and_all_parts():
    first = rehearsal.merge([_doc(("01_a.ipynb", True)), _doc(("04_b.ipynb", False))])
    again = _doc(("04_b.ipynb", True))
    merged = rehearsal.merge([first, again], replace=True)
    assert [(r["notebook"], r["completed"]) for r in merged["lessons"]] == \
        [("01_a.ipynb", True), ("04_b.ipynb", True)]
    assert len(merged["parts"]) == 3
    other = _doc()
    other["card_facts"] = dict(other["card_facts"], memory_gib=15.0)
    with pytest.raises(ValueError, match="different cards"):
        rehearsal.merge([_doc(("01_a.ipynb", True)), other])


@pytest.mark.parametrize("damage,message", [
    (lambda d: None, "a JSON object is needed"),
    (lambda d: dict(d, card="a100"), "card must be one of t4"),
    (lambda d: {k: v for k, v in d.items() if k != "card_facts"}, "card_facts must hold"),
    (lambda d: dict(d, lessons="x"), "lessons must be a list"),
    (lambda d: dict(d, lessons=["x"]), r"lessons\[0\] must be an object"),
    (lambda d: dict(d, lessons=[dict(d["lessons"][0], seconds=None)]), r"lessons\[0\].seconds"),
    (lambda d: dict(d, lessons=[dict(d["lessons"][0], completed="yes")]), "completed must be"),
    (lambda d: dict(d, lessons=[dict(d["lessons"][0], peak_gpu_mib=-1)]), "peak_gpu_mib"),
    (lambda d: dict(d, lessons=[dict(d["lessons"][0], not_run=[1])]), "not_run must be"),
])
def test_malformed_records_are_named_not_crashed_on(damage, message):
    bad = damage(_doc(("01_a.ipynb", True)))
    with pytest.raises(ValueError, match=message):
        rehearsal.merge([_doc(("02_b.ipynb", True)), bad])
    with pytest.raises(ValueError, match="is not a rehearsal record: .*" + message):
        rehearsal.markdown(bad)


def test_cli_rehearse_update_merges_into_the_record(tmp_path, capsys, monkeypatch):
    record = tmp_path / "rehearsal_t4.json"
    record.write_text(json.dumps(rehearsal.merge([_doc(("01_x.ipynb", False))])))
    nb = _notebook(tmp_path / "01_x.ipynb", "1 + 1")
    monkeypatch.delenv(env.SIMULATE_VARIABLE, raising=False)
    before = record.read_text()
    # a CPU run (or a quick one) is refused before anything runs: it would replace the GPU's
    # records under the same heading (it did, from an outside review)
    assert cli.main(["rehearse", "--profile", "quick", "--out", str(tmp_path / "o"),
                     "--update", str(record), str(nb)]) == 2
    assert "update: only a rehearsal on a CUDA GPU" in capsys.readouterr().err
    assert record.read_text() == before and not (tmp_path / "o").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "--profile quick" in cli.update_problem("quick") and cli.update_problem("full") == ""
    monkeypatch.undo()
    monkeypatch.setattr(cli, "update_problem", lambda profile: "")  # the merge itself, here
    status = cli.main(["rehearse", "--profile", "quick", "--out", str(tmp_path / "o"),
                       "--update", str(record), str(nb)])
    assert status == 0, capsys.readouterr().err
    doc = json.loads(record.read_text())
    assert [(r["notebook"], r["completed"]) for r in doc["lessons"]] == [("01_x.ipynb", True)]
    assert len(doc["parts"]) == 2
    record.write_text("not json")
    assert cli.main(["rehearse", "--out", str(tmp_path / "o"), "--update", str(record), str(nb)]) == 2


def test_cli_rehearse_checks_the_record_before_running(tmp_path, capsys):
    nb = _notebook(tmp_path / "01_x.ipynb", "1")
    record = tmp_path / "r.json"
    for bad in ("[]", "{}", json.dumps({"card": "a100", "lessons": []})):
        record.write_text(bad)
        assert cli.main(["rehearse", "--out", str(tmp_path / "o"), "--update", str(record),
                         str(nb)]) == 2
        assert "is not a rehearsal record" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing ran


def test_readme_command_writes_both_blocks_or_nothing(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")  # no rehearsal markers
    from amp_lessons.publish import report
    readme.write_text(f"{report.START}\nold\n{report.END}\n")
    before = readme.read_text()
    assert cli.main(["readme", "--readme", str(readme)]) == 2
    assert "rehearsal markers" in capsys.readouterr().err
    assert readme.read_text() == before  # the results block was not written alone


def _smi_with(apps):
    """A stand-in for nvidia-smi on a machine with two GPUs."""
    def query(args):
        if args[0] == "--query-gpu=index,uuid":
            return [["0", "GPU-aaa"], ["1", "GPU-bbb"]]
        return apps
    return query


def test_gpu_in_use_names_other_processes_on_the_visible_gpus(monkeypatch):
    me = os.getpid()
    apps = [[str(me), "GPU-aaa", "700"], ["999999", "GPU-aaa", "5000"],
            ["999998", "GPU-bbb", "[N/A]"], ["x"]]
    monkeypatch.setattr(rehearsal, "_query", _smi_with(apps))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    busy = rehearsal.gpu_in_use()
    assert busy == [{"gpu": "0", "pid": 999999, "used_mib": 5000.0},
                    {"gpu": "1", "pid": 999998, "used_mib": None}]   # not this process itself
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [b["pid"] for b in rehearsal.gpu_in_use()] == [999998]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa")
    assert [b["pid"] for b in rehearsal.gpu_in_use()] == [999999]
    assert rehearsal.busy_gpu_text(rehearsal.gpu_in_use()) == \
        "GPU 0 is in use by pid 999999 (5,000 MiB)"
    monkeypatch.setattr(rehearsal, "_query", lambda args: (_ for _ in ()).throw(OSError("no smi")))
    assert rehearsal.gpu_in_use() is None and rehearsal.wait_for_idle_gpu(0) == []
    with pytest.raises(ValueError, match="wait_s must be"):
        rehearsal.wait_for_idle_gpu(-1)


def test_a_busy_gpu_stops_a_run_and_a_rehearsal_before_they_measure(tmp_path, monkeypatch, capsys):
    busy = [{"gpu": "0", "pid": 4242, "used_mib": 1024.0}]
    monkeypatch.setattr(rehearsal, "wait_for_idle_gpu", lambda *a, **k: busy)
    nb = _notebook(tmp_path / "01_x.ipynb", "1 + 1")
    assert cli.main(["run-notebooks", "--out", str(tmp_path / "o"), str(nb)]) == 1
    err = capsys.readouterr().err
    assert "01_x.ipynb: not run: GPU 0 is in use by pid 4242 (1,024 MiB)" in err
    assert not (tmp_path / "o" / "01_x.ipynb").exists()
    record = rehearsal.rehearse_notebook(nb, "t4", tmp_path / "r")
    assert record["completed"] is False and "pid 4242" in record["error"]
    rehearsal.check_record({"card": "t4", "card_facts": {"name": "Tesla T4", "memory_gib": 14.4},
                            "lessons": [record]})
