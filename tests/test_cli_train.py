"""`python -m amp_lessons train`: end to end in the quick sizes, and its errors."""
import json
import subprocess
import sys

import pytest

from amp_lessons.cli import main

FAST = ["--model", "cnn", "--width", "4", "--batch-size", "256", "--no-progress"]


def test_train_end_to_end_with_json_checkpoint_and_resume(tmp_path, capsys):
    out, ckpt = tmp_path / "run.json", tmp_path / "c.pt"
    assert main(["train", "--precision", "amp", "--epochs", "1", "--checkpoint", str(ckpt),
                 "--json", str(out), "--clip", "1.0"] + FAST) == 0
    text = capsys.readouterr().out
    assert "epoch 1/1:" in text and "test accuracy" in text and "peak memory" in text
    assert "summary: cnn at fp16" in text and "--precision amp took about 5.8 GB" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["precision"] == "fp16" and len(doc["epochs"]) == 1
    assert doc["args"]["clip"] == 1.0 and len(doc["history"]["loss"]) == 6
    assert main(["train", "--precision", "amp", "--epochs", "2", "--resume", str(ckpt)]
                + FAST) == 0
    text = capsys.readouterr().out
    assert "epoch 2/2:" in text and "epoch 1/2" not in text and ", 2 epochs" in text


@pytest.mark.parametrize("argv,message", [
    (["--precision", "fp8"], "invalid choice"),
    (["--model", "resnet"], "invalid choice"),
    (["--epochs", "0"], "expected a whole number >= 1"),
    (["--lr", "fast"], "expected a number"),
    (["--growth-factor", "1.0"], "growth_factor must be a finite number > 1"),
    (["--backoff-factor", "2"], r"backoff_factor must be in the open interval \(0, 1\)"),
    (["--init-scale", "-1"], "init_scale must be a finite number > 0"),
    (["--growth-interval", "0"], "growth_interval must be a whole number >= 1"),
    (["--clip", "0"], "clip_norm must be None or a finite number > 0"),
    (["--lr", "0"], "lr must be a finite number > 0"),
    (["--seed", "-2"], "seed must be a whole number >= 0"),
    (["--resume", "missing.pt"], "resume must name an existing checkpoint file"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train"] + argv + FAST)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    import re
    assert re.search(message, err), err


def test_module_entry_point_exit_status():
    proc = subprocess.run([sys.executable, "-m", "amp_lessons", "train", "--accumulate", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
