"""Provenance is recorded from the code that ran: traced calls (``amp_lessons.lineage``), the call
path at publish time, the code that computes each column; ``explain`` prints it back from the
executed notebooks, fast, and refuses an empty or unknown key in one line."""
import json
import linecache
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from amp_lessons import cli, tables
from amp_lessons import lineage
from amp_lessons.measure import BenchConfig, published_rows, run_configs, with_ratios
from amp_lessons.publish import notebooks, provenance, report

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(model="resnet18", batch_size=2, image_size=16, num_classes=10)


def _cell(source: str, name: str, scope: dict):
    """Run ``source`` as a notebook kernel runs a cell: its code kept in linecache."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), scope)
    return scope


@lineage.traced
def _measure_one(setting, scale=2):
    return {"name": setting["name"], "value": setting["x"] * scale}


@lineage.traced
def _measure_all(settings):
    return [_measure_one(s) for s in settings]


@lineage.traced
def _shown(rows):
    return [{"setting": r["name"], "value x 10": 10 * r["value"]} for r in rows]


def test_a_traced_call_records_its_arguments_inner_calls_and_rows():
    rows = _measure_all([{"name": "a", "x": 1}, {"name": "b", "x": 2}])
    outer = lineage.origin(rows)
    assert outer.name.endswith("_measure_all") and outer.file.endswith("test_provenance.py")
    assert [c.name.rsplit(".", 1)[1] for c in outer.calls] == ["_measure_one", "_measure_one"]
    # each row keeps the innermost call that made it, with its own arguments
    assert lineage.origin(rows[1]).arguments == {"setting": {"name": "b", "x": 2}}
    shown = _shown(rows)
    assert lineage.origin(shown).inputs["rows"] is outer
    # row i of a table made from as many traced rows comes from row i
    assert lineage.source_row(shown[1]) is rows[1]
    assert lineage.origin(5) is None and lineage.origin({"untraced": 1}) is None


def test_traced_leaves_the_function_as_it_was():
    assert _measure_one({"name": "a", "x": 3}, scale=3) == {"name": "a", "value": 9}
    assert _measure_one.__name__ == "_measure_one" and "lineage" not in (_measure_one.__doc__ or "")
    with pytest.raises(KeyError):
        _measure_one({})
    assert lineage.current() is None  # the failed call left no frame behind
    with pytest.raises(ValueError, match="traced decorates a function"):
        lineage.traced(3)


def test_short_arguments_stay_small_and_json():
    cfg = BenchConfig(precision="bf16", **TINY)
    assert lineage.short(cfg)["precision"] == "bf16"
    assert lineage.short([1, 2, 3]) == [1, 2, 3]
    assert lineage.short([{"a": 1}] * 3) == "<list of 3>"
    assert lineage.short(float("nan")) == "nan" and lineage.short("x" * 500).endswith("...")
    json.dumps(lineage.short(cfg))


def test_each_measured_row_names_the_step_it_timed():
    """A row timed through the Trainer names trainer_step, a hand-written one hand_step (the
    registry typed by hand named hand_step for a table whose fastest row ran the Trainer)."""
    configs = [BenchConfig(precision="fp32", **TINY),
               BenchConfig(precision="fp32", loop="trainer", label="through the Trainer", **TINY)]
    rows = run_configs(configs, "cpu", warmup=0, steps=1, breakdown=False, progress=False)
    table = with_ratios(rows, baseline=rows[0]["label"])
    scope = _cell("bundle = report.result_bundle('lesson04.resnet', published_rows(table), 't',"
                  " caller=sys._getframe())\n", "<cell-resnet>",
                  {"report": report, "published_rows": published_rows, "table": table, "sys": sys})
    prov = scope["bundle"][report.RESULT_MIME]["provenance"]
    hand, trainer = prov["rows"]
    assert hand["ran"][0].endswith("measure.steps.hand_step")
    assert trainer["ran"][0].endswith("measure.steps.trainer_step")
    assert trainer["configuration"]["loop"] == "trainer" and hand["configuration"]["loop"] == "hand"
    assert trainer["made by"][-1] == "amp_lessons.measure.runner.measure"
    assert all(r["ran"][-1].endswith("measure.timer.time_steps") for r in (hand, trainer))
    assert prov["made by"][0]["function"] == "amp_lessons.measure.rows.published_rows"
    assert "published_rows(table)" in prov["published by"][-1]["code"]
    assert prov["columns"]["img/s"]["code"] == '("img_per_s", "img/s")'
    text = provenance.explain("lesson04.resnet", dict(scope["bundle"][report.RESULT_MIME],
                                                      notebook="04.ipynb", run={}))
    assert "ran measure.steps.trainer_step" in text and "loop='trainer'" in text
    assert text.count("\n  ") >= 6 and "code version: not recorded" in text


def test_a_function_called_inside_the_publish_call_is_named_and_its_columns_traced():
    """``publish(key, technique_report_rows(rows))``: a function called in the publish call
    itself is recorded from the cell's code; its columns from its own code."""
    rows = [{"technique": "fp32", "status": "ok", "step_ms": 2.0, "img_per_s": 1.0,
             "memory_gib": 1.0, "config": {"batch_size": 4}}]
    scope = _cell("rec = provenance.record('k.x', tables.technique_report_rows(rows), "
                  "sys._getframe())\n", "<cell-techniques>",
                  {"provenance": provenance, "tables": tables, "rows": rows, "sys": sys})
    rec = scope["rec"]
    assert rec["made by"][0]["function"] == "amp_lessons.tables.technique_report_rows"
    assert rec["made by"][0]["file"] == "amp_lessons/tables.py"
    step = rec["columns"]["step ms"]
    assert step["function"] == "amp_lessons.tables.technique_report_rows"
    assert "step_ms" in step["code"] and step["file"] == "amp_lessons/tables.py"
    assert rec["rows"][0]["made by"] == ["amp_lessons.tables.technique_report_rows"]


@lineage.traced
def _examine(name):
    advice = tables.format_value(2.5)          # a package function computes the field
    exponent = tables.plural(3, "step")
    return SimpleNamespace(name=name, advice=advice, exponent=exponent)


@lineage.traced
def _summary(reports):
    return [{"model": n, "train in": r.advice, "loss scale": r.exponent}
            for n, r in reports.items()]


def test_a_column_read_from_a_traced_report_names_the_function_that_computed_that_field():
    """lesson09.summary's "loss scale" comes from the doctor's scale path: a column that reads a
    field of a traced input names the function that computed that field."""
    reports = {"a": _examine("a"), "b": _examine("b")}
    scope = _cell("rec = provenance.record('k.summary', _summary(reports), sys._getframe())\n",
                  "<cell-summary>", {"provenance": provenance, "_summary": _summary,
                                     "reports": reports, "sys": sys})
    columns = scope["rec"]["columns"]
    assert [f["function"] for f in columns["train in"]["fields from"]] == \
        ["amp_lessons.tables.format_value"]
    assert [f["function"] for f in columns["loss scale"]["fields from"]] == \
        ["amp_lessons.tables.plural"]
    assert columns["loss scale"]["code"] == "r.exponent"


def test_rows_projected_in_the_cell_are_traced_by_their_content():
    rows = _measure_all([{"name": "p", "x": 7}])
    scope = _cell("rec = provenance.record('k.p', [{'name': r['name']} for r in rows], "
                  "sys._getframe())\n", "<cell-projection>",
                  {"provenance": provenance, "rows": rows, "sys": sys})
    assert scope["rec"]["rows"][0]["made by"][-1].endswith("_measure_one")


def test_code_version_names_the_commit_and_a_dirty_tree(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    (tmp_path / "run.ipynb").write_text("{}")  # a notebook the run rewrites does not count
    got = notebooks.code_version(tmp_path)
    assert len(got["commit"]) == 40 and got["clean"] is True
    (tmp_path / "code.py").write_text("x = 1\n")
    got = notebooks.code_version(tmp_path)
    assert got["clean"] is False and got["changed"] == ["code.py"]
    assert "uncommitted changes in the tree: code.py" in provenance.code_version({"code": got})
    outside = tmp_path / "no_git"
    outside.mkdir()
    (outside / ".git").write_text("not a repository")
    assert notebooks.code_version(outside)["commit"] is None
    assert provenance.code_version({}).startswith("not recorded")


def test_explain_refuses_an_empty_or_unknown_key_in_one_line(capsys):
    for bad in ("", "   "):
        assert cli.main(["explain", bad]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "empty key" in err
    assert cli.main(["explain", "lesson4.resnet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "did you mean lesson04.resnet" in err
    assert cli.main(["explain", "zzz"]) == 2
    assert "run without KEY to list" in capsys.readouterr().err


def test_close_keys():
    keys = ["lesson04.resnet", "lesson05.techniques", "claims.l04"]
    assert provenance.close_keys("lesson05.technique", keys)[0] == "lesson05.techniques"
    assert provenance.close_keys("resnet", keys) == ["lesson04.resnet"]
    assert provenance.close_keys("qqqq", keys) == []


def test_explain_lists_keys_and_prints_the_recorded_run(capsys):
    assert cli.main(["explain"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "lesson04.resnet" in listed and "claims.l04" in listed and len(listed) >= 20
    assert cli.main(["explain", "lesson04.resnet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lesson04.resnet: ") and "code version: " in out


def test_explain_imports_no_engine_and_runs_no_lesson():
    """``explain`` reads what the executed notebooks recorded: no lesson, engine or plotting
    module is imported (they took it to 43-52 s)."""
    code = ("import sys\nfrom amp_lessons import cli\ncli.build_parser()\nbefore = set(sys.modules)\n"
            "assert cli.main(['explain', 'lesson05.techniques']) == 0\n"
            "heavy = [m for m in set(sys.modules) - before if m.startswith(("
            "'amp_lessons.lessons', 'amp_lessons.measure', 'amp_lessons.train', "
            "'amp_lessons.doctor', 'amp_lessons.ui', 'plotly', 'nbformat', 'ipywidgets'))]\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lesson05.techniques: " in done.stdout


def _plain_summary(reports):  # untraced, as a lesson function called inside publish(...)
    return [{"model": n, "loss scale": r.exponent} for n, r in reports.items()]


def test_an_untraced_function_called_in_the_publish_call_keeps_each_row_traced():
    """``publish(key, lesson.summary(reports))``: the reports were traced; the rows the untraced
    summary made from them, one per report, lead back to each report's call."""
    reports = {"a": _examine("a"), "b": _examine("b")}
    scope = _cell("rec = provenance.record('k.s', _plain_summary(reports), sys._getframe())\n",
                  "<cell-plain-summary>", {"provenance": provenance, "reports": reports,
                                           "_plain_summary": _plain_summary, "sys": sys})
    rec = scope["rec"]
    assert [r["made by"][-1].rsplit(".", 1)[1] for r in rec["rows"]] == ["_examine", "_examine"]
    assert [r["configuration"] for r in rec["rows"]] == [{"name": "a"}, {"name": "b"}]
    assert [f["function"] for f in rec["columns"]["loss scale"]["fields from"]] == \
        ["amp_lessons.tables.plural"]


def test_code_version_of_a_copy_holds_only_where_its_files_match(tmp_path, monkeypatch):
    """A GPU host gets the working tree with a stale .git: the run records the source's commit
    only if the files there hash to the source's files; an edited file makes it unclean."""
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "x")
    record = notebooks.copy_code_version(tmp_path)
    monkeypatch.setenv(notebooks.EXPECT_COMMIT_VARIABLE, record)
    (tmp_path / "lesson.ipynb").write_text("{}")  # a notebook the run rewrites does not count
    got = notebooks.code_version(tmp_path)
    assert got["clean"] is True and len(got["commit"]) == 40
    (tmp_path / "code.py").write_text("x = 2\n")
    got = notebooks.code_version(tmp_path)
    assert got["clean"] is False and "not those of the copy's source" in got["reason"]
    monkeypatch.setenv(notebooks.EXPECT_COMMIT_VARIABLE, "not json")
    with pytest.raises(ValueError, match="AMP_LESSONS_EXPECT_COMMIT"):
        notebooks.code_version(tmp_path)


def _untraced_rows(rows):
    return [{"setting": r["name"]} for r in rows]


def test_rows_no_traced_call_made_are_said_so_and_refused_where_provenance_is_required(
        monkeypatch):
    rows = _untraced_rows([{"name": "a"}, {"name": "b"}])  # "a" is a traced row's too
    rec = provenance.record("k.untraced", rows)
    assert [r["made by"] for r in rec["rows"]] == [None, None]  # said, not guessed
    monkeypatch.setenv(provenance.REQUIRE_ENV, "1")
    with pytest.raises(provenance.UntracedRowsError, match=r"k.untraced: rows 1 \(a\), 2 \(b\) "
                                                          r"of 2 came from no traced call"):
        provenance.record("k.untraced", rows)
    traced_rows = _shown(_measure_all([{"name": "a", "x": 1}]))
    rec = provenance.record("k.traced", traced_rows)  # a traced table passes
    assert rec["rows"][0]["made by"][0].endswith("_shown")


def test_each_verdict_row_leads_back_to_the_function_that_decided_it():
    """``claims.decides`` records every call of a decider, and ``publish_verdicts`` makes row
    ``i`` from verdict ``i``: explain names the decider and its arguments."""
    from amp_lessons.lessons import l01_ranges
    from amp_lessons.publish.claims import deciders

    name = deciders()["R1"]
    decider = getattr(l01_ranges, name.rsplit(".", 1)[1])
    assert getattr(decider, "traced", False) and decider.decides == ("R1",)
    verdict = l01_ranges.verdict_r1(l01_ranges.check_r1())
    rows = report.verdict_rows([verdict])
    rec = provenance.record("claims.l01", rows)
    assert rec["rows"][0]["made by"] == ["amp_lessons.publish.report.verdict_rows", name]
