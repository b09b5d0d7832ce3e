import pytest
import torch

import amp_lessons as al
from amp_lessons import env as envmod


def test_profile_defaults_by_hardware(monkeypatch):
    monkeypatch.delenv("AMP_LESSONS_PROFILE", raising=False)
    assert al.get_profile() == ("full" if torch.cuda.is_available() else "quick")


@pytest.mark.parametrize("value,expected", [("quick", "quick"), ("full", "full"), (" FULL ", "full")])
def test_profile_from_environment(monkeypatch, value, expected):
    monkeypatch.setenv("AMP_LESSONS_PROFILE", value)
    assert al.get_profile() == expected


def test_unknown_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AMP_LESSONS_PROFILE", "fast")
    with pytest.raises(ValueError, match="AMP_LESSONS_PROFILE must be one of quick, full; got 'fast'"):
        al.get_profile()


def test_setup_reports_and_seeds(capsys, monkeypatch):
    monkeypatch.setenv("AMP_LESSONS_PROFILE", "quick")
    env = al.setup(seed=3)
    out = capsys.readouterr().out
    for word in ("platform", "device", "capability", "torch", "profile    : quick"):
        assert word in out
    a = torch.rand(3)
    al.setup(seed=3, quiet=True)
    assert torch.equal(a, torch.rand(3))
    assert env.profile == "quick" and env.quick and env.seed == 3
    assert env.device_type == env.device.type
    assert env.amp_dtype in (torch.float16, torch.bfloat16)
    assert env.as_dict()["device"] == str(env.device)
    assert "profile=quick" in env.describe()


def test_setup_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("AMP_LESSONS_PROFILE", raising=False)
    env = al.setup(quiet=True)
    assert env.device == torch.device("cpu") and env.profile == "quick"
    assert env.capability is None and not env.is_cuda and not env.fp16_tensor_cores


@pytest.mark.parametrize("variables,expected", [({}, "local"), ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "kaggle"),
                                                ({"COLAB_RELEASE_TAG": "release"}, "colab")])
def test_detect_platform(monkeypatch, variables, expected):
    for name in ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE", "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if expected != "colab":
        monkeypatch.delitem(__import__("sys").modules, "google.colab", raising=False)
    assert envmod.detect_platform() == expected


def test_seed_rejects_bad_values():
    with pytest.raises(ValueError, match="seed must be a whole number >= 0"):
        al.seed_everything(-1)


def test_default_device_matches_cuda():
    assert envmod.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_submodule():
    with pytest.raises(AttributeError):
        al.does_not_exist


def test_allocatable_bytes_is_the_simulated_cards_memory(monkeypatch):
    """140 GiB of GPU (stood in for on a CPU): all of it, or the T4's 14.4 GiB when simulated."""
    import types
    import torch
    from amp_lessons import env as E
    assert E.allocatable_bytes("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.delenv(E.SIMULATE_VARIABLE, raising=False)
    assert E.allocatable_bytes("cuda") == 140 * 2**30
    monkeypatch.setenv(E.SIMULATE_VARIABLE, "t4")
    assert E.allocatable_bytes("cuda") == int(E.CARD_FACTS["t4"]["memory_gib"] * 2**30)
    assert E.CARD_FACTS["t4"]["memory_gib"] < E.CARD_FACTS["t4"]["total_gib"]
