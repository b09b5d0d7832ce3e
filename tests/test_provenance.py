"""Every published table can be traced: ``python -m amp_lessons explain KEY`` names the functions
(file and line) from the table to the code that measured it, and ``report.publish`` keeps what
produced the table (functions, configurations, device, torch) inside its bundle."""
import json
import re
from pathlib import Path

import pytest

from amp_lessons import cli
from amp_lessons.publish import report
from amp_lessons.measure import BenchConfig, measure
from amp_lessons.publish import provenance

ROOT = Path(__file__).resolve().parent.parent
PUBLISH = re.compile(r"publish\(\s*[\"']([a-z0-9._-]+)[\"']")


def _published_keys():
    keys = set()
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        keys |= set(PUBLISH.findall(code))
        if "publish_verdicts(" in code:
            keys.add(f"{report.VERDICT_PREFIX}l{nb.name[:2]}")
    return sorted(keys)


def test_the_notebooks_publish_tables():
    keys = _published_keys()
    assert "lesson05.techniques" in keys and "lesson04.resnet" in keys and len(keys) >= 20


@pytest.mark.parametrize("key", _published_keys())
def test_every_published_key_can_be_explained(key):
    chain = provenance.producers(key)
    assert chain, key
    for name in chain:
        where = provenance.locate(name)
        path = ROOT / where["file"]
        assert path.is_file() and where["line"] >= 1, where
        lines = path.read_text().splitlines()
        assert re.match(rf"\s*(def|class) {where['function'].split('.')[-1]}\b",
                        lines[where["line"] - 1]) or lines[where["line"] - 1].lstrip().startswith("@"), where
    text = provenance.explain(key)
    assert text.startswith(f"{key}:") and chain[0].rsplit(".", 1)[1] in text


def test_timed_tables_end_at_the_timer():
    for key in ("lesson04.resnet", "lesson04.claim-r6", "lesson05.techniques", "lesson05.frontier",
                "lesson06.cnn-wrapping", "lesson06.transformer-scaling", "lesson07.speed",
                "lesson08.recipes", "lesson09.summary", "lesson09.resnet_vs_lesson04"):
        assert provenance.producers(key)[-1] == "amp_lessons.measure.timer.time_steps", key


def test_unknown_keys_and_names_are_refused():
    with pytest.raises(ValueError, match="published table's key"):
        provenance.producers("lesson42.nothing")
    with pytest.raises(ValueError, match="does not name"):
        provenance.locate("amp_lessons.measure.no_such_function")
    with pytest.raises(ValueError, match="label must be"):
        provenance.remember(3, {})


def test_a_published_bundle_records_what_produced_it():
    cfg = BenchConfig(model="resnet18", batch_size=2, image_size=32, num_classes=10,
                      label="tiny traced row")
    row = measure(cfg, "cpu", warmup=0, steps=1, breakdown=False, idle=False)
    assert row["status"] == "ok"
    bundle = report.result_bundle("lesson04.resnet", [{"configuration": row["label"],
                                                      "img/s": row["img_per_s"]}], "t")
    prov = bundle[report.RESULT_MIME]["provenance"]
    assert prov["produced_by"][-1]["function"] == "time_steps"
    assert prov["produced_by"][-1]["file"].endswith("measure/timer.py")
    assert prov["configurations"] == [dict(prov["configurations"][0], label="tiny traced row")]
    assert prov["configurations"][0]["model"] == "resnet18" and prov["torch"]
    text = provenance.explain("lesson04.resnet", dict(bundle[report.RESULT_MIME],
                                                      notebook="04.ipynb", run={"id": "r1"}))
    assert "configuration: label=tiny traced row" in text and "run: id=r1" in text
    assert "amp_lessons/measure/timer.py:" in text


def test_explain_command_prints_every_key(capsys):
    assert cli.main(["explain", "lesson05.techniques"]) == 0
    out = capsys.readouterr().out
    assert "lesson05.techniques" in out and "measure/timer.py:" in out
    assert cli.main(["explain", "lesson42.nothing"]) != 0


def test_a_table_no_lesson_declares_is_published_and_said_to_be_unexplained():
    prov = provenance.record("lesson99.scratch", [{"a": 1}])
    assert prov["produced_by"] == [] and "published table's key" in prov["unexplained"]
