"""An outside review of the training helpers with other models and inputs (checkpoint,
checkpointing, fp8, data, precision): each class of bug it reproduced, held by a test."""
import pytest
import torch
from torch import nn

from amp_lessons.measure import activation_checkpointing as K
from amp_lessons import data as D
from amp_lessons.numerics import fp8 as F8
from amp_lessons import models as M
from amp_lessons.numerics import precision as P
from amp_lessons.train.checkpoint import CheckpointError, check_optimizer_state


# --- fp8: saturation, tiny and empty tensors -------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,shape", [("tensorwise", (8,)), ("rowwise", (4, 8))])
def test_dynamic_scaling_clips_nothing_so_reports_no_saturation(fmt, granularity, shape):
    """amax lands on the format's largest value give or take an fp32 ulp: not clipped (381 of
    2,000 random tensors read as saturated before)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        x = torch.randn(shape, generator=g) * 3
        assert F8.quantization_error(x, fmt, granularity)["saturated"] == 0.0
    assert F8.quantization_error(torch.tensor([10.62462043762207, 1.0, -3.0, 0.5]), "e4m3",
                                 "tensorwise")["saturated"] == 0.0


def test_unscaled_values_past_the_range_still_count_as_saturated():
    assert F8.quantization_error(torch.tensor([500.0, 1.0]), "e4m3", "none")["saturated"] == 0.5


def test_tiny_tensors_reach_the_top_of_the_range_and_zero_ones_keep_a_finite_scale():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-18
    assert float(F8.amax_scale(x, "e4m3") * x.abs().max()) == pytest.approx(448.0)
    assert F8.quantization_error(x, "e4m3")["underflow"] == 0.0  # was 0.96
    for p2 in (False, True):
        scale = F8.amax_scale(torch.zeros(3), "e4m3", power_of_2=p2)
        assert torch.isfinite(scale)
        assert torch.equal(F8.fake_quantize(torch.zeros(3), power_of_2=p2), torch.zeros(3))


@pytest.mark.parametrize("granularity,shape,scale_shape", [
    ("tensorwise", (0, 4), ()), ("tensorwise", (0,), ()), ("rowwise", (4, 0), (4, 1)),
    ("rowwise", (0, 4), (0, 1))])
def test_empty_tensors_round_trip_with_scale_one(granularity, shape, scale_shape):
    x = torch.zeros(shape)
    assert F8.amax_scale(x, "e4m3", granularity).shape == scale_shape
    assert F8.fake_quantize(x, granularity=granularity).shape == x.shape


# --- checkpointing: SAC without the fix, the caller's RNG, batch 1 ---------------------------

@pytest.mark.skipif(M.selective_checkpointing_problem() is not None, reason="needs torch >= 2.5")
def test_sac_without_the_batchnorm_fix_really_has_no_fix():
    r = K.checkpoint_equivalence("resnet18", "sac", image_size=32, batch_size=2, device="cpu")
    assert r["batches_tracked"] == {"plain": 1, "checkpointed": 1,
                                    "checkpointed without the fix": 2}
    assert r["bn_rel_diff"] == 0.0 and r["bn_rel_diff_without_fix"] > 0
    net = M.without_batchnorm_fix(M.resnet18(10, checkpoint="sac", small_input=True))
    assert not any(type(u) is M.SelectiveCheckpointed for u in net.modules())


@pytest.mark.parametrize("call", [
    lambda: K.checkpoint_equivalence("resnet18", "block", 32, 2, device="cpu", seed=0),
    lambda: K.checkpoint_sequential_pitfall(4, 32, 2, device="cpu", model="resnet18", seed=0)],
    ids=["checkpoint_equivalence", "checkpoint_sequential_pitfall"])
def test_checkpointing_measurements_leave_the_callers_random_stream_alone(call):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    call()
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_equivalence_names_a_batch_of_one():
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 2; got 1"):
        K.checkpoint_equivalence("resnet18", "block", image_size=32, batch_size=1, device="cpu")


# --- checkpoint: another optimizer's state -----------------------------------------------------

def _stepped(opt_class, **kw):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = opt_class(m.parameters(), **kw)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_another_kind_of_optimizers_state_is_refused_naming_what_is_missing():
    m, rms = _stepped(torch.optim.RMSprop, lr=1e-3)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=r"param group 0 lacks 'betas', which Adam needs"):
        check_optimizer_state(rms.state_dict(), adam)
    # its own kind loads, also where a scheduler added initial_lr to the live groups only
    _, other = _stepped(torch.optim.Adam, lr=1e-3)
    torch.optim.lr_scheduler.StepLR(adam, 1)
    check_optimizer_state(other.state_dict(), adam)


# --- data and precision: devices this machine lacks, negative indices ------------------------

@pytest.mark.parametrize("call", [
    lambda: D.synthetic_images(2, 8, device="cuda"), lambda: D.digits("train", device="cuda"),
    lambda: D.digits_loaders(8, device="cuda:1"), lambda: P.check_precision("fp32", "cuda")])
def test_a_cuda_device_without_cuda_is_named_not_a_driver_error(monkeypatch, call):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device must be an available device; got 'cuda(:1)?' "
                                         r"but CUDA is not available \(use 'cpu'\)"):
        call()


def test_a_gpu_past_the_last_one_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device must be a CUDA device in \[0, 1\]; got 'cuda:2'"):
        P.available_device("cuda:2")
    assert P.available_device("cuda:1") == torch.device("cuda", 1)
    assert P.available_device("cpu") == torch.device("cpu")


def test_a_negative_cuda_index_is_named():
    with pytest.raises(ValueError, match="device must be a CUDA index >= 0; got -1"):
        P.as_device(-1)


# --- spreads past 100% (the CLI review: doctor --out report.html crashed) -------------------

def test_a_spread_past_100_percent_is_shown_not_raised_nor_clamped():
    from amp_lessons.measure import rows as R
    from amp_lessons.doctor.report import DoctorReport
    from amp_lessons.tables import percent, spread_text

    assert spread_text(0.0123) == percent(0.0123, 1.0) and spread_text(1.0) == "100.0%"
    assert spread_text(8.188529515752963) == "818.9%"
    assert spread_text(0.9999999) == "100.0%" and spread_text(1.004) == "100.4%"
    for bad in (-0.1, float("nan"), None, "0.5"):
        with pytest.raises(ValueError, match="spread must be a number >= 0"):
            spread_text(bad)
    assert DoctorReport._cell("spread", 37.55) == "3,755.0%"
    (_, _, fmt), = [c for c in R.DEFAULT_COLUMNS if c[0] == "spread"]
    assert fmt(2.5) == "250.0%"  # was clamped to "100%"


def test_resuming_in_another_precision_is_refused(tmp_path):
    """``train --resume`` ran epoch 1 in fp32 and epoch 2 in fp16 and reported the run as fp16
    (an outside review of the CLI): a resumed run continues exactly as it started."""
    from amp_lessons.train.recipes import train_digits

    ck = tmp_path / "ck.pt"
    train_digits("fp32", model="mlp", epochs=1, device="cpu", checkpoint=ck, progress=False)
    with pytest.raises(ValueError, match=r"resume: '.*ck.pt' was trained in fp32; this run asks "
                                         r"for bf16: resume with precision 'fp32'"):
        train_digits("bf16", model="mlp", epochs=2, device="cpu", resume=ck, progress=False)
    run = train_digits("fp32", model="mlp", epochs=2, device="cpu", resume=ck, progress=False)
    assert len(run.epochs) == 2


def test_epochs_and_sampler_settings_are_checked_not_truncated():
    """``set_epoch(1.7)`` was silently epoch 1 (a resumed run could reuse another epoch's
    order); strings and negative sizes gave int() or torch errors that named nothing."""
    tb = D.TensorBatches(torch.arange(6.0), torch.arange(6), 2)
    sampler = D.EpochShuffleSampler(5)
    loader = D.EpochDataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)),
                               sampler=D.EpochShuffleSampler(6), batch_size=2)
    for obj in (tb, sampler, loader):
        for bad in (1.7, "one", -1, None):
            with pytest.raises(ValueError, match="epoch must be a whole number >= 0"):
                obj.set_epoch(bad)
        obj.set_epoch(2)
    assert tb.epoch == sampler.epoch == loader.sampler.epoch == 2
    with pytest.raises(ValueError, match="n must be a whole number >= 0; got -1"):
        D.EpochShuffleSampler(-1)
    for make in (lambda: D.EpochShuffleSampler(4, seed="x"),
                 lambda: D.EpochDataLoader([1, 2], seed=-3)):
        with pytest.raises(ValueError, match="seed must be a whole number >= 0"):
            make()


def test_autocast_error_by_op_names_a_bad_dtype_and_bad_logit_scales():
    for kw, message in ((dict(dtype=["bf16"]), "dtype must be 'fp16', 'bf16'"),
                        (dict(dtype="bf16", logit_scales=("8",)), "logit_scales must be"),
                        (dict(dtype="bf16", logit_scales=8.0), "logit_scales must be"),
                        (dict(dtype="bf16", logit_scales=(0.0,)), "logit_scales must be")):
        with pytest.raises(ValueError, match=message):
            P.autocast_error_by_op("cpu", **kw)


def test_runconfig_reads_precision_names_as_the_package_does_and_checks_its_label():
    from amp_lessons.measure import distributed as Dd

    assert Dd.RunConfig(precision="AMP").precision == "fp16"
    assert Dd.RunConfig(precision=" bf16 ").precision == "bf16"
    for label in (5, ["x"]):
        with pytest.raises(ValueError, match="label must be a string"):
            Dd.RunConfig(label=label)
    with pytest.raises(ValueError, match="precision must be one of"):
        Dd.RunConfig(precision="fp64")


def test_checkpoint_paths_and_map_location_are_named(tmp_path):
    """A bad map_location was reported as an unreadable (intact) file; a path of the wrong type
    gave pathlib's TypeError."""
    from amp_lessons.train import checkpoint as C

    path = C.atomic_save({"a": torch.ones(1)}, tmp_path / "ok.pt")
    with pytest.raises(ValueError, match="map_location must be a device .*; got 'gpu0'"):
        C.read_verified(path, map_location="gpu0")
    for bad in (None, 5, True):
        with pytest.raises(ValueError, match="path must be a file path"):
            C.read_verified(bad)
        with pytest.raises(ValueError, match="path must be a file path"):
            C.atomic_save({"a": 1}, bad)
    for where in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda s, loc: s, None):
        assert torch.equal(C.read_verified(path, map_location=where)["a"], torch.ones(1))
