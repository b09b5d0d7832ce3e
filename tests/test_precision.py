"""Precisions, defined once: names, devices, autocast contexts, TF32 switches, bf16 support."""
import pytest
import torch

from amp_lessons import env
from amp_lessons.numerics import precision
from amp_lessons import data as D


def test_normalize_precision():
    assert precision.normalize_precision(" AMP ") == "fp16"
    assert precision.normalize_precision("bf16") == "bf16"
    for bad in ("fp8", 16, None):
        with pytest.raises(ValueError, match="precision must be one of"):
            precision.normalize_precision(bad)


def test_as_device_has_one_meaning_of_none():
    assert precision.as_device(None) == env.default_device()
    assert precision.as_device("cpu") == torch.device("cpu")
    assert precision.as_device(1) == torch.device("cuda", 1)
    for bad in (True, "gpu-ish", 1.5):
        with pytest.raises(ValueError, match="device must be"):
            precision.as_device(bad)


def test_check_precision_on_cpu():
    assert precision.check_precision("amp", "cpu") == "fp16"
    assert precision.check_precision("tf32", "cpu") == "tf32"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            precision.check_precision("fp16", "cuda")


def test_autocast_for():
    x = torch.ones(4, 4)
    with precision.autocast_for("bf16", "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    with precision.autocast_for("bf16", "cpu", cache_enabled=False):
        assert (x @ x).dtype == torch.bfloat16
    with precision.autocast_for("fp32", "cpu"):
        assert (x @ x).dtype == torch.float32
    assert set(precision.HALF_DTYPES) == {"fp16", "bf16"}


def test_native_bf16_and_the_t4_simulation(monkeypatch):
    assert precision.native_bf16("cpu") is True
    monkeypatch.setenv(env.SIMULATE_VARIABLE, "t4")
    assert env.simulated_card() == "t4"
    assert precision.native_bf16("cpu") is True  # the CPU is not simulated
    monkeypatch.setenv(env.SIMULATE_VARIABLE, "a100")
    with pytest.raises(ValueError, match="AMP_LESSONS_SIMULATE must be one of t4"):
        env.simulated_card()


def test_precision_settings_restores_tf32_state():
    before = precision._get_tf32()
    with precision.precision_settings("tf32"):
        pass
    with precision.precision_settings("fp32"):
        pass
    assert precision._get_tf32() == before


def test_tf32_is_native_only_on_ampere_or_newer_gpus():
    assert precision.native_tf32("cpu") is False


def test_simulated_card_changes_what_probe_reports_without_a_gpu(monkeypatch):
    monkeypatch.setenv(env.SIMULATE_VARIABLE, "t4")
    assert env.device_capability("cpu") is None
    assert env.apply_simulation("cpu") is None  # nothing to cap on a CPU
    e = env.probe("quick")
    assert e.device.type == "cpu" or e.capability == (7, 5)


@pytest.mark.parametrize("call", [
    lambda: D.synthetic_images(2, 8, device="cuda"), lambda: D.digits("train", device="cuda"),
    lambda: D.digits_loaders(8, device="cuda:1"), lambda: precision.check_precision("fp32", "cuda")])
def test_a_cuda_device_without_cuda_is_named_not_a_driver_error(monkeypatch, call):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device must be an available device; got 'cuda(:1)?' "
                                         r"but CUDA is not available \(use 'cpu'\)"):
        call()


def test_a_gpu_past_the_last_one_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device must be a CUDA device in \[0, 1\]; got 'cuda:2'"):
        precision.available_device("cuda:2")
    assert precision.available_device("cuda:1") == torch.device("cuda", 1)
    assert precision.available_device("cpu") == torch.device("cpu")


def test_a_negative_cuda_index_is_named():
    with pytest.raises(ValueError, match="device must be a CUDA index >= 0; got -1"):
        precision.as_device(-1)


def test_autocast_error_by_op_names_a_bad_dtype_and_bad_logit_scales():
    for kw, message in ((dict(dtype=["bf16"]), "dtype must be 'fp16', 'bf16'"),
                        (dict(dtype="bf16", logit_scales=("8",)), "logit_scales must be"),
                        (dict(dtype="bf16", logit_scales=8.0), "logit_scales must be"),
                        (dict(dtype="bf16", logit_scales=(0.0,)), "logit_scales must be")):
        with pytest.raises(ValueError, match=message):
            precision.autocast_error_by_op("cpu", **kw)
