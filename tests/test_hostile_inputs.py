"""Inputs a learner or a sweep hands over that once slipped through: NumPy scalars, NaN, values a
control would clamp, a format name as a plain string, numbers beyond float64. Each either works
or raises a ValueError that names the setting and its range; a measurement fed NaN never decides."""
import math

import numpy as np
import pytest

from amp_lessons import measure
from amp_lessons.publish import claims
from amp_lessons.numerics import formats
from amp_lessons.validate import check_bool, check_int, check_real, is_int, is_real
from amp_lessons.lessons import l01_ranges as L01
from amp_lessons.lessons import l03_scaler as L03
from amp_lessons.ui import scaler_panels as U03
from amp_lessons.lessons import l04_resnet50 as L04
from amp_lessons.train.trainer import ScalerSettings
from amp_lessons.ui import widgets
from amp_lessons.ui.controls import NumberField, parse_number


# ---- the one set of checks ----------------------------------------------------------------------

def test_numpy_scalars_count_as_numbers_bools_do_not():
    assert is_int(np.int64(3)) and is_int(7) and not is_int(True) and not is_int(3.0)
    assert is_real(np.float32(0.5)) and not is_real(np.bool_(True)) and not is_real(math.nan)
    assert check_int("n", np.int32(4), 1) == 4 and type(check_int("n", np.int32(4), 1)) is int
    assert check_bool("flag", np.bool_(True)) is True
    assert check_real("x", np.float64(0.25), 0.0, 1.0) == 0.25


@pytest.mark.parametrize("kwargs,match", [
    (dict(value=0.0, low=0.0, low_open=True), r"x must be a finite number > 0; got 0.0"),
    (dict(value=1.0, low=0.0, high=1.0, high_open=True), r"in \[0, 1\)"),
    (dict(value=5, high=4), r"<= 4"),
    (dict(value=math.nan), r"x must be a finite number; got nan"),
    (dict(value="1"), r"got '1'"),
])
def test_check_real_names_the_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_real("x", **kwargs)


def test_scaler_settings_take_numpy_and_refuse_what_float32_cannot_hold():
    s = ScalerSettings(init_scale=np.float32(1024), growth_interval=np.int64(5),
                       enabled=np.bool_(True))
    assert s.init_scale == 1024.0 and type(s.growth_interval) is int and s.enabled is True
    for bad in (1e39, 1e-46, 2.0 ** 128):
        with pytest.raises(ValueError, match=r"init_scale must be .*\[2\*\*-126, 2\*\*127\]"):
            ScalerSettings(init_scale=bad)


def test_bench_config_checks_every_flag_and_number():
    cfg = measure.BenchConfig(batch_size=np.int64(32), lr=np.float32(0.5), channels_last=True)
    assert type(cfg.batch_size) is int and cfg.batch_size == 32 and type(cfg.lr) is float
    for kwargs, match in ((dict(channels_last="yes"), "channels_last must be True or False"),
                          (dict(cuda_graph=1), "cuda_graph must be True or False"),
                          (dict(amsgrad="False"), "amsgrad must be True or False"),
                          (dict(lr=True), "lr must be a finite number > 0"),
                          (dict(lr="0.1"), "lr must be a finite number > 0"),
                          (dict(eps=None), r"eps must be a finite number in \(0, 1\)"),
                          (dict(label=3), "label must be a string")):
        with pytest.raises(ValueError, match=match):
            measure.BenchConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [(dict(steps=0), "steps must be a whole number >= 1"),
                                          (dict(steps=2.0), "steps must be a whole number"),
                                          (dict(warmup=-1), "warmup must be a whole number >= 0")])
def test_measure_raises_on_bad_arguments_instead_of_an_error_row(kwargs, match):
    cfg = measure.BenchConfig(model="resnet18", batch_size=2, image_size=32, num_classes=10)
    with pytest.raises(ValueError, match=match):
        measure.measure(cfg, "cpu", **kwargs)
    with pytest.raises(ValueError, match=match):
        measure.run_configs([cfg], "cpu", progress=False, **kwargs)


# ---- gates: NaN and out-of-range numbers never decide -------------------------------------------

def test_gates_never_let_nan_decide():
    assert "not a fraction" in claims.accuracy_gate(math.nan, 10)
    assert "not a fraction" in claims.accuracy_gate(5.0, 10)
    assert claims.accuracy_gate(0.9, 10) is None
    with pytest.raises(ValueError, match="classes must be a whole number >= 2"):
        claims.accuracy_gate(0.9, 0)
    assert "idle share" in claims.timing_gate("cuda", 15, 1, math.nan)
    assert claims.timing_gate("cuda", 15, 1, 0.1) is None
    with pytest.raises(ValueError, match="steps must be a whole number"):
        claims.timing_gate("cuda", math.nan, 1)
    assert measure.idle_fraction(5.0, math.nan) is None
    assert measure.idle_fraction(math.nan, 5.0) is None
    assert measure.idle_fraction(1.0, 4.0) == 0.75
    reason = L04.accuracy_reason({"accuracy": 0.95}, {"accuracy": math.nan})
    assert reason is not None and "not a fraction" in reason


# ---- panels: nothing is clamped or silently changed ----------------------------------------------

def test_bit_explorer_sign_flips_the_typed_value():
    b = widgets.BitExplorer(0.1)
    for typed, negated in (("0", -0.0), ("inf", -math.inf), ("1e10", -1e10),
                           ("2**-40", -(2.0 ** -40))):
        b.text.value = typed
        b.negative.value = True
        assert b.value == negated and math.copysign(1.0, b.value) < 0, typed
        b.negative.value = False
        assert b.value == -negated and parse_number(b.text.value) == -negated, typed
    b.text.value = "nan"
    b.negative.value = True
    assert math.isnan(b.value) and math.copysign(1.0, b.value) < 0


@pytest.mark.parametrize("text,flipped", [("0.1", "-0.1"), ("-inf", "inf"), ("+3", "-3"),
                                          ("2**-40", "-(2**-40)"), ("-(2**-40)", "2**-40"),
                                          ("2-3", "-(2-3)"), ("-(1)-(2)", "-(-(1)-(2))")])
def test_negated_text(text, flipped):
    assert widgets.negated_text(text) == flipped
    assert parse_number(flipped) == -parse_number(text)


@pytest.mark.parametrize("kwargs,match", [
    (dict(settings=ScalerSettings(init_scale=40000)), r"init_scale \(log2\) must be a whole number"),
    (dict(settings=ScalerSettings(init_scale=2.0 ** 40)), r"init_scale \(log2\) .*\[-10, 32\]"),
    (dict(settings=ScalerSettings(growth_factor=10)), r"growth_factor must be a number in \[1.05, 8\]"),
    (dict(settings=ScalerSettings(growth_factor=1.01)), r"growth_factor must be"),
    (dict(settings=ScalerSettings(backoff_factor=0.99)), r"backoff_factor must be .*0.95"),
    (dict(injection_rate=2.0), r"injected overflow rate must be a number in \[0, 1\]"),
    (dict(injection_rate=-0.5), r"injected overflow rate"),
    (dict(injection_rate="x"), r"injected overflow rate"),
    (dict(steps=math.nan), r"steps must be a whole number in \[1, 100000\]; got nan"),
    (dict(steps=math.inf), r"steps must be"),
    (dict(steps="abc"), r"steps must be"),
    (dict(steps=True), r"steps must be"),
])
def test_scaler_panel_refuses_starting_values_its_controls_would_clamp(kwargs, match):
    kwargs.setdefault("steps", 5)
    with pytest.raises(ValueError, match=match):
        U03.scaler_panel(figure_mode="output", background=False, **kwargs)


def test_scaler_panel_keeps_starting_values_in_range():
    p = U03.scaler_panel(steps=7, settings=ScalerSettings(init_scale=2.0 ** 20, growth_factor=3.0,
                                                          backoff_factor=0.25),
                         injection_rate=0.3, figure_mode="output", background=False)
    s = p.settings()
    assert (s.init_scale, s.growth_factor, s.backoff_factor) == (2.0 ** 20, 3.0, 0.25)
    assert p._rate == 0.3 and p.steps.value == 7


def test_preset_comparison_refuses_a_rate_outside_0_1():
    with pytest.raises(ValueError, match="injected overflow rate must be a number in"):
        widgets.PresetComparison({"a": ScalerSettings()}, lambda *a: None, injection_rate=5.0,
                                 figure_mode="output")


def test_number_field_names_an_upper_bound_and_refuses_a_bad_start():
    f = NumberField("limit", 5, None, 10)
    f.text.value = "11"
    assert "limit must be a number &lt;= 10" in f.message.value
    with pytest.raises(ValueError, match=r"steps must be a whole number in \[1, 9\]; got nan"):
        NumberField("steps", math.nan, 1, 9, integer=True)
    with pytest.raises(ValueError, match="low must be <= high"):
        NumberField("x", 1, 5, 2)


# ---- formats: one name, exponents, numbers beyond float64 -----------------------------------------

def test_a_single_format_name_is_one_format():
    assert [r["format"] for r in formats.format_facts("fp16")] == ["fp16"]
    assert "fp16" in formats.bits_table_text([1.0], names="fp16")
    assert widgets.BitExplorer(1.0, formats_shown="bf16").formats == ("bf16",)
    with pytest.raises(ValueError, match="names must name at least one format"):
        formats.format_facts([])


@pytest.mark.parametrize("k", [1100, -1100, 3.5, True])
def test_scale_exponents_outside_float64_are_refused(k):
    g = [1e-3, 2e-5]
    with pytest.raises(ValueError, match=r"exponents must be integers in \[-1074, 1023\]"):
        formats.scale_sweep(g, [k])
    with pytest.raises(ValueError, match=r"exponents must be integers in \[-1074, 1023\]"):
        formats.scale_report({"a": g}, [k])


def test_slider_ranges_stay_inside_float64():
    with pytest.raises(ValueError, match=r"k_range must be two integers .*\[-1074, 1023\]"):
        widgets.LossScaleExplorer({"a": [1e-3]}, k_range=(0, 2000), figure_mode="output")
    with pytest.raises(ValueError, match="log2_range must be two integers"):
        widgets.BitExplorer(1.0, log2_range=(5, 2))


def test_numbers_beyond_float64_are_refused_the_same_way():
    for text in ("1e400", "1e308*10", "10**400", "-1e400"):
        with pytest.raises(ValueError, match="beyond float64's largest value"):
            parse_number(text)
    assert parse_number("inf") == math.inf and parse_number("-inf*2") == -math.inf
    with pytest.raises(ValueError, match="value must be within float64's range"):
        formats.decode(10 ** 400, "fp16")
    with pytest.raises(ValueError, match="x must hold numbers within float64's range"):
        formats.round_trip(10 ** 400, "fp16")
    with pytest.raises(ValueError, match="value must be a number within float64's range"):
        widgets.BitExplorer(10 ** 400)


def test_matches_written_reads_any_plain_decimal():
    assert L01.matches_written(".5", 0.5) and L01.matches_written("6.55e4", 65504.0)
    assert not L01.matches_written("1e400", 1.0) and not L01.matches_written("5.96e-8", math.nan)
    assert L01.matches_written("5.96e-8", 2.0 ** -24) and not L01.matches_written("5.97e-8", 2.0 ** -24)


# ---- the rest of the package: NumPy counts, seeds, flags, devices, env variables -----------------

def test_numpy_counts_and_seeds_work_everywhere():
    import torch
    from amp_lessons import data
    from amp_lessons import env
    from amp_lessons import models
    from amp_lessons.train.trainer import TrainConfig
    from amp_lessons.measure.distributed import RunConfig
    cfg = TrainConfig(accumulate=np.int64(2), seed=np.int64(3), progress=False)
    assert type(cfg.accumulate) is int and type(cfg.seed) is int
    x, y = data.synthetic_images(np.int64(2), 8, seed=np.int64(1))
    assert x.shape == (2, 3, 8, 8)
    train, _ = data.digits_loaders(np.int64(16), seed=np.int64(2))
    assert train.batch_size == 16 and len(next(iter(train))[0]) == 16
    assert isinstance(models.SimpleNet(np.int64(64)), torch.nn.Module)
    env.seed_everything(np.int64(3))
    RunConfig(lr=np.float32(1e-3), init_scale=np.float32(1024), seed=np.int64(1))


@pytest.mark.parametrize("call,match", [
    (lambda: __import__("amp_lessons.data").data.digits_loaders(True), "batch_size must be"),
    (lambda: __import__("amp_lessons.data").data.synthetic_images(True, 8), "batch_size must be"),
    (lambda: __import__("amp_lessons.data").data.synthetic_images(2, 8, seed=1.5), "seed must be"),
    (lambda: __import__("amp_lessons.data").data.synthetic_images(2, 8, seed=2**70), "2\\*\\*63"),
    (lambda: __import__("amp_lessons.data").data.synthetic_images(2, 8, channels_last="yes"),
     "channels_last must be True or False"),
    (lambda: __import__("amp_lessons.data").data.synthetic_images(2, 8, device="gpu"),
     "device must be"),
    (lambda: __import__("amp_lessons.data").data.digits("train", None, "gpu"), "device must be"),
    (lambda: __import__("amp_lessons.data").data.digits_loaders(64, seed=1.5), "seed must be"),
    (lambda: __import__("amp_lessons.env").env.seed_everything(2**70), "seed must be"),
    (lambda: __import__("amp_lessons.env").env.get_profile(5), "profile must be one of"),
    (lambda: ScalerSettings(growth_interval=np.float64(3.0)), "growth_interval must be"),
    (lambda: __import__("amp_lessons.train.trainer").trainer.TrainConfig(seed=2**70), "seed must be"),
    (lambda: __import__("amp_lessons.models").models.MLP(hidden=128), "hidden must be a sequence"),
    (lambda: __import__("amp_lessons.models").models.build_digits_model("simplenet", "x"),
     "width must be"),
    (lambda: __import__("amp_lessons.models").models.resnet18(small_input="no"),
     "small_input must be True or False"),
    (lambda: __import__("amp_lessons.measure.distributed").distributed.RunConfig(model_kwargs={"foo": 1}),
     "model_kwargs .* do not build"),
    (lambda: __import__("amp_lessons.measure.distributed").distributed.RunConfig(init_scale=1e300),
     "init_scale must be"),
    (lambda: __import__("amp_lessons.lessons.l02_amp_loop").lessons.l02_amp_loop.verdict_b6([1]),
     "caught must hold"),
    (lambda: __import__("amp_lessons.lessons.l02_amp_loop").lessons.l02_amp_loop
     .clip_order_experiment(None), "max_norm must be a finite number > 0"),
])
def test_bad_values_name_the_setting(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_checkpoint_path_under_a_file_says_so(tmp_path):
    from amp_lessons.train import checkpoint as C
    (tmp_path / "file").write_text("x")
    with pytest.raises(C.CheckpointError, match="a part of its folder is a file"):
        C.atomic_save({"a": 1}, tmp_path / "file" / "ck.pt")


@pytest.mark.parametrize("variable", ["AMP_LESSONS_PROFILE", "AMP_LESSONS_SIMULATE"])
def test_cli_names_a_junk_environment_variable_in_one_line(variable, monkeypatch, capsys):
    from amp_lessons import cli
    monkeypatch.setenv(variable, "junk")
    assert cli.main(["bench", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{variable} must be one of" in err and "Traceback" not in err and err.count("\n") == 1


def test_distributed_cli_refuses_nproc_0(capsys):
    from amp_lessons.measure import distributed
    with pytest.raises(SystemExit):
        distributed.main(["--nproc", "0"])
    assert "--nproc must be a whole number >= 1" in capsys.readouterr().err


# ---- every command-line path ends in one line, never a traceback (issue 41) -----------------------

@pytest.fixture
def hostile_files(tmp_path):
    """Files a hostile but fair user hands the commands: not UTF-8, empty, a folder, read-only,
    a notebook whose cells are a number, a JSON list, random bytes named .pt."""
    (tmp_path / "latin.md").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    (tmp_path / "cells5.ipynb").write_text('{"cells": 5}')
    (tmp_path / "list.ipynb").write_text("[]")
    (tmp_path / "latin.ipynb").write_bytes(b"\xff\xfe{")
    (tmp_path / "random.pt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.txt").write_text("x")
    locked = tmp_path / "locked.md"
    locked.write_text("keep me")
    locked.chmod(0o444)
    yield tmp_path
    locked.chmod(0o644)


HOSTILE_ARGV = [
    # readme
    ["readme", "--readme", "{d}/missing.md"], ["readme", "--readme", "{d}/folder"],
    ["readme", "--readme", "{d}/latin.md"], ["readme", "--readme", "{d}/locked.md"],
    ["readme", "--check", "--readme", "{d}/latin.md"],
    # claims
    ["claims", "--out", "{d}/folder"], ["claims", "--out", "{d}/text.txt/sub.md"],
    ["claims", "--out", "{d}/locked.md"], ["claims", "--check", "--out", "{d}/latin.md"],
    ["claims", "--check", "--out", "{d}/folder"],
    # notebooks
    ["run-notebooks", "{d}/missing.ipynb"], ["run-notebooks", "{d}/folder"],
    ["run-notebooks", "{d}/cells5.ipynb"], ["run-notebooks", "{d}/list.ipynb"],
    ["run-notebooks", "{d}/latin.ipynb"], ["run-notebooks", "--timeout", "-5", "{d}/x.ipynb"],
    ["run-notebooks", "--timeout", "99999999999999999999999", "{d}/latin.ipynb"],
    ["figure-images", "{d}/missing.ipynb"], ["figure-images", "{d}/text.txt"],
    ["figure-images", "{d}/latin.ipynb"], ["figure-images", "{d}/folder"],
    ["rehearse", "--card", "", "--out", "{d}/r", "{d}/latin.ipynb"],
    ["rehearse", "--card", "h100", "--out", "{d}/r"],
    ["rehearse", "--out", "{d}/text.txt", "{d}/cells5.ipynb"],
    ["rehearse", "--out", "{d}/r", "--update", "{d}/empty.json", "{d}/list.ipynb"],
    # bench: refused before anything is measured
    ["bench", "--batch-size", "0"], ["bench", "--batch-size", "-3"], ["bench", "--steps", "0"],
    ["bench", "--warmup", "-1"], ["bench", "--image-size", "4"], ["bench", "--json", "{d}/folder"],
    ["bench", "--json", "{d}/locked.md"], ["bench", "--image-size", "1e3"],
    # train: refused before anything is trained
    ["train", "--epochs", "-1"], ["train", "--epochs", "0"], ["train", "--lr", "-1"],
    ["train", "--lr", "nan"], ["train", "--lr", "1e400"], ["train", "--lr", ""],
    ["train", "--seed", str(2 ** 64)], ["train", "--seed", "-1"],
    ["train", "--growth-interval", str(2 ** 70)], ["train", "--init-scale", "1e-50"],
    ["train", "--backoff-factor", "1"], ["train", "--growth-factor", "1"],
    ["train", "--clip", "0"], ["train", "--clip", "inf"], ["train", "--width", "0"],
    ["train", "--resume", "{d}/folder"], ["train", "--resume", "{d}/random.pt"],
    ["train", "--resume", "{d}/empty.pt"], ["train", "--resume", "{d}/missing.pt"],
    ["train", "--json", "{d}/locked.md"], ["train", "--checkpoint", "{d}/folder"],
    ["train", "--checkpoint", "{d}/text.txt/c.pt"],
]


@pytest.mark.parametrize("argv", HOSTILE_ARGV, ids=lambda a: " ".join(a).replace("{d}/", ""))
def test_every_command_answers_hostile_input_in_one_line(hostile_files, argv, capsys):
    from amp_lessons.cli import main

    argv = [a.replace("{d}", str(hostile_files)) for a in argv]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse: usage, then one error line
        status = exit_.code
    err = capsys.readouterr().err
    assert status in (1, 2), err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m amp_lessons {argv[0]}: error: ") or (
        argv[0] == "claims" and "--check" in argv and "no such file" in last), err
    assert (hostile_files / "locked.md").read_text() == "keep me"
    assert not list(hostile_files.glob(".*.tmp-*"))  # no temporary file left


def test_is_out_of_memory_knows_the_cpu_allocators_words():
    import torch

    from amp_lessons.measure.oom import is_out_of_memory

    try:
        torch.empty(2 ** 62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_out_of_memory(exc), str(exc)
    else:
        pytest.skip("this machine allocated 4 EiB")
    assert not is_out_of_memory(RuntimeError("shape '[2, 3]' is invalid"))
