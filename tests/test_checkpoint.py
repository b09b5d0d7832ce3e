"""amp_lessons.train.checkpoint and Trainer.save_checkpoint/load_checkpoint: atomic saves, verified
all-or-nothing loads, exact resume, temporary files, file modes, a full disk."""
import errno
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from amp_lessons.train import checkpoint as C
from amp_lessons.train import trainer as T
from amp_lessons.data import TensorBatches
from trainer_helpers import assert_same_tensors, batches, fresh, make_data, optimizer_tensors
from amp_lessons.train.checkpoint import CheckpointError, check_optimizer_state


# --- checkpoints ---------------------------------------------------------------------------------

def run_with_resume(tmp_path, precision, split_at):
    """Train 2 epochs of 5 steps, saving after ``split_at`` steps and resuming in a new trainer."""
    x, y = make_data(80)

    def build():
        model, opt = fresh(dropout=0.3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        cfg = T.TrainConfig(precision=precision, progress=False, clip_norm=5.0)
        return T.Trainer(model, opt, cfg, scheduler=sched), TensorBatches(x, y, 16, seed=3)

    first, loader = build()
    first.fit(loader, epochs=2, max_steps=split_at)
    path = tmp_path / f"{precision}.pt"
    first.save_checkpoint(path)
    torch.manual_seed(1234)  # disturb every generator: the checkpoint must restore them
    torch.rand(100)
    second, loader = build()
    second.load_checkpoint(path)
    assert second.step == split_at
    second.fit(loader, epochs=2 - second.epoch)  # a half-done epoch counts as one
    return second


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("split_at", [3, 5])
def test_resume_equals_uninterrupted(tmp_path, precision, split_at):
    x, y = make_data(80)
    model, opt = fresh(dropout=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    whole = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False,
                                                clip_norm=5.0), scheduler=sched)
    whole.fit(TensorBatches(x, y, 16, seed=3), epochs=2)
    resumed = run_with_resume(tmp_path, precision, split_at)
    assert resumed.step == whole.step == 10 and resumed.epoch == whole.epoch == 2
    assert_same_tensors(resumed.model.state_dict(), whole.model.state_dict())
    assert_same_tensors(optimizer_tensors(resumed.optimizer), optimizer_tensors(whole.optimizer))
    a, b = resumed.history.columns(), whole.history.columns()
    for name in ("loss", "scale", "skipped", "grad_norm", "lr", "step", "epoch"):
        assert a[name] == b[name], name
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()
    assert resumed.scaler.state_dict() == whole.scaler.state_dict()


def test_checkpoint_loads_with_weights_only(tmp_path):
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        scheduler=sched)
    trainer.fit(batches(2))
    path = trainer.save_checkpoint(tmp_path / "c.pt")
    state = torch.load(path, weights_only=True)
    assert state["format"] == T.CHECKPOINT_FORMAT and state["step"] == 2
    assert isinstance(state["rng"]["torch"], torch.Tensor)
    assert state["scaler"]["scale"] == 65536.0


def trained(precision="fp32", steps=2, **kwargs):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False), **kwargs)
    trainer.fit(batches(steps))
    return trainer


def live_tensors(trainer):
    out = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    out.update({f"opt.{k}": v.clone() for k, v in optimizer_tensors(trainer.optimizer).items()})
    return out


def test_atomic_save_survives_a_failure_mid_write(tmp_path, monkeypatch):
    trainer = trained()
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path)
    good = path.read_bytes()
    trainer.fit(batches(2))

    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # writes everything...
        raise OSError("cable pulled")  # ...then dies before the rename

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="cable pulled"):
        trainer.save_checkpoint(path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left behind
    other = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    other.load_checkpoint(path)
    assert other.step == 2


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = trained()
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path)
    good = path.read_bytes()
    trainer.fit(batches(2))
    real_write = C._HashingWriter.write
    written = []

    def write(self, data):
        if sum(written) > 2000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        written.append(len(data))
        return real_write(self, data)

    monkeypatch.setattr(C._HashingWriter, "write", write)
    with pytest.raises(C.DiskFullError, match="disk full: could not write checkpoint .*ckpt.pt"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_checkpoint_files_get_the_mode_torch_save_gives(tmp_path):
    old = os.umask(0o022)
    try:
        trained().save_checkpoint(tmp_path / "c.pt")
        torch.save({}, tmp_path / "plain.pt")
    finally:
        os.umask(old)
    mode = (tmp_path / "c.pt").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.pt").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("damage,message", [
    ("empty", "the file is empty"),
    ("truncated", "truncated or damaged archive"),
    ("random", "not a PyTorch archive"),
    ("state_dict", r"holds a plain state dict \(torch.save\(model.state_dict\(\)\)"),
    ("other_dict", "not a checkpoint written by Trainer.save_checkpoint"),
    ("folder", "is a folder"),
    ("missing", "no such checkpoint file"),
])
def test_files_that_are_not_a_checkpoint_get_one_clear_error(tmp_path, damage, message):
    trainer = trained()
    path = tmp_path / "c.pt"
    trainer.save_checkpoint(path)
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "random":
        path.write_bytes(os.urandom(4096))
    elif damage == "state_dict":
        torch.save(trainer.model.state_dict(), path)
    elif damage == "other_dict":
        torch.save({"x": 1}, path)
    elif damage == "folder":
        path.unlink()
        path.mkdir()
    else:
        path.unlink()
    other = T.Trainer(*fresh(seed=1), T.TrainConfig(progress=False))
    before = live_tensors(other)
    with pytest.raises(C.CheckpointError, match=message) as exc:
        other.load_checkpoint(path)
    assert isinstance(exc.value, ValueError) and str(path) in str(exc.value)
    assert len(str(exc.value).splitlines()) == 1
    assert_same_tensors(live_tensors(other), before)


def test_every_flipped_byte_is_detected(tmp_path):
    """Silent corruption: flip one byte anywhere (the archive, its padding, the trailer)."""
    trainer = trained()
    path = tmp_path / "c.pt"
    trainer.save_checkpoint(path)
    data = path.read_bytes()
    other = T.Trainer(*fresh(seed=1), T.TrainConfig(progress=False))
    before = live_tensors(other)
    positions = sorted(set(range(0, len(data), max(1, len(data) // 150)))
                       | {len(data) // 2, len(data) - 1, len(data) - 30})
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(C.CheckpointError):
            other.load_checkpoint(path)
    assert_same_tensors(live_tensors(other), before)
    path.write_bytes(data)
    other.load_checkpoint(path)  # the intact file still loads


def test_checkpoint_is_still_a_plain_torch_file(tmp_path):
    path = trained().save_checkpoint(tmp_path / "c.pt")
    assert torch.load(path, weights_only=True)["format"] == T.CHECKPOINT_FORMAT


def test_loads_are_all_or_nothing(tmp_path):
    """Another model shape, another optimizer, another scheduler: refused before anything
    live changes (model, optimizer, scaler, scheduler, counters)."""
    # another shape: a wider Linear
    wide = nn.Sequential(nn.Flatten(), nn.Linear(64, 12))
    t_wide = T.Trainer(wide, torch.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9),
                       T.TrainConfig(progress=False))
    t_wide.train_step([(torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))])
    t_wide.save_checkpoint(tmp_path / "wide.pt")
    narrow = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    t_narrow = T.Trainer(narrow, torch.optim.SGD(narrow.parameters(), lr=0.1, momentum=0.9),
                         T.TrainConfig(progress=False))
    t_narrow.train_step([(torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))])
    before = live_tensors(t_narrow)
    with pytest.raises(C.CheckpointError, match=r"wide.pt: model: 1.weight is \(12, 64\)"):
        t_narrow.load_checkpoint(tmp_path / "wide.pt")
    assert_same_tensors(live_tensors(t_narrow), before) and t_narrow.step == 1

    # same model, another optimizer's state (Adam into SGD)
    model, _ = fresh()
    adam = T.Trainer(model, torch.optim.Adam(model.parameters()), T.TrainConfig(progress=False))
    adam.fit(batches(2))
    adam.save_checkpoint(tmp_path / "adam.pt")
    sgd = trained("fp16")
    before, scale = live_tensors(sgd), sgd.scaler.state_dict()
    with pytest.raises(C.CheckpointError, match="optimizer: the checkpoint holds Adam state"):
        sgd.load_checkpoint(tmp_path / "adam.pt")
    assert_same_tensors(live_tensors(sgd), before)
    assert sgd.scaler.state_dict() == scale and sgd.step == 2

    # same optimizer kind, another parameter grouping (two groups into one)
    model, _ = fresh()
    groups = [{"params": [model.conv.weight, model.conv.bias]},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("conv")]}]
    two = T.Trainer(model, torch.optim.SGD(groups, lr=0.1, momentum=0.9),
                    T.TrainConfig(progress=False))
    two.fit(batches(1))
    two.save_checkpoint(tmp_path / "groups.pt")
    with pytest.raises(C.CheckpointError, match="optimizer: does not fit this optimizer"):
        sgd.load_checkpoint(tmp_path / "groups.pt")
    assert_same_tensors(live_tensors(sgd), before)

    # a scheduler of another kind
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with_sched = T.Trainer(model, opt, T.TrainConfig(progress=False), scheduler=sched)
    with_sched.fit(batches(1))
    with_sched.save_checkpoint(tmp_path / "steplr.pt")
    model, opt = fresh()
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    other = T.Trainer(model, opt, T.TrainConfig(progress=False), scheduler=cosine)
    before, sched_state = live_tensors(other), cosine.state_dict()
    with pytest.raises(C.CheckpointError, match="scheduler: the checkpoint holds another kind"):
        other.load_checkpoint(tmp_path / "steplr.pt")
    assert_same_tensors(live_tensors(other), before) and cosine.state_dict() == sched_state


@pytest.mark.parametrize("damage,message", [
    (lambda st: st["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)), "rng: the state cannot"),
    (lambda st: st["rng"]["numpy"].pop("pos"), "rng: the state cannot"),
    (lambda st: st["history"].update(epochs=[5]), "history epochs must be a list"),
    (lambda st: st["history"].update(steps="abc"), "history steps must be a dict"),
])
def test_a_damaged_rng_or_history_changes_nothing(tmp_path, monkeypatch, damage, message):
    """Saved with a consistent checksum but a state that cannot be restored: refused before the
    model, optimizer or step counter change (the load is all or nothing)."""
    source = trained("fp16")
    real_save = C.atomic_save

    def save_damaged(state, path, *args, **kwargs):
        damage(state)
        return real_save(state, path, *args, **kwargs)

    monkeypatch.setattr(T, "atomic_save", save_damaged)
    source.save_checkpoint(tmp_path / "damaged.pt")
    monkeypatch.undo()
    target = trained("fp16")
    before, step = live_tensors(target), target.step
    with pytest.raises(C.CheckpointError, match=message):
        target.load_checkpoint(tmp_path / "damaged.pt")
    assert_same_tensors(live_tensors(target), before) and target.step == step


def test_load_checkpoint_errors(tmp_path):
    trainer = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    with pytest.raises(C.CheckpointError, match="missing.pt: no such checkpoint file"):
        trainer.load_checkpoint(tmp_path / "missing.pt")
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    T.Trainer(model, opt, T.TrainConfig(progress=False), scheduler=sched).save_checkpoint(
        tmp_path / "s.pt")
    with pytest.raises(C.CheckpointError, match="scheduler: the checkpoint holds a scheduler state"):
        trainer.load_checkpoint(tmp_path / "s.pt")


def test_a_checkpoint_without_a_scheduler_is_refused_by_a_trainer_with_one(tmp_path):
    """The schedule would restart at 0 while the step counter resumes: refused, unless the
    checkpoint was saved before any step."""
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    plain = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    plain.save_checkpoint(tmp_path / "start.pt")
    plain.train_step([(x, y)])
    plain.save_checkpoint(tmp_path / "later.pt")
    model, opt = fresh()
    scheduled = T.Trainer(model, opt, T.TrainConfig(progress=False),
                          scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    scheduled.load_checkpoint(tmp_path / "start.pt")  # step 0: a fresh schedule is right
    with pytest.raises(C.CheckpointError, match=r"this Trainer has a StepLR but the checkpoint "
                                                r"\(step 1\) was saved without one"):
        scheduled.load_checkpoint(tmp_path / "later.pt")


# --- temporary files of interrupted saves --------------------------------------------------------

KILLED_SAVER = r"""
import os, sys, torch
from amp_lessons.train import checkpoint as C
real = torch.save
def save(obj, f, *a, **k):
    f.write(b"partial bytes")
    os.kill(os.getpid(), 9)
torch.save = save
C.atomic_save({"x": torch.ones(3)}, sys.argv[1])
"""


def test_kill_9_during_a_save_leaves_no_temporary_file_for_long(tmp_path):
    path = tmp_path / "c.pt"
    C.atomic_save({"x": torch.zeros(2)}, path)
    good = path.read_bytes()
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", KILLED_SAVER, str(path)])
        assert proc.returncode == -9
    # each save removed what the one killed before it left: only the last one's file remains
    left = [p for p in os.listdir(tmp_path) if p != "c.pt"]
    assert len(left) == 1 and left[0].startswith(".c.pt.tmp-")
    assert path.read_bytes() == good  # the checkpoint itself is intact
    C.read_verified(path)  # the next load (or save) removes what dead processes left
    assert os.listdir(tmp_path) == ["c.pt"]


def test_stale_cleanup_never_touches_a_live_process_file(tmp_path):
    path = tmp_path / "c.pt"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f".c.pt.tmp-{C.host_tag()}-{sleeper.pid}-abcd1234"
        live.write_bytes(b"being written")
        other_host = tmp_path / ".c.pt.tmp-otherhost-1-abcd1234"
        other_host.write_bytes(b"someone else's")
        unrelated = tmp_path / ".d.pt.tmp-x"
        unrelated.write_bytes(b"")
        C.atomic_save({"x": torch.ones(1)}, path)
        assert live.exists() and other_host.exists() and unrelated.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert C.remove_stale_temp_files(path) == [live]


def test_load_checkpoint_can_keep_the_scaler(tmp_path):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    trainer.train_step([batches(1)[0]])
    trainer.save_checkpoint(tmp_path / "c.pt")
    other = T.Trainer(*fresh(), T.TrainConfig(precision="fp16", progress=False,
                                              scaler=T.ScalerSettings(init_scale=8.0)))
    other.load_checkpoint(tmp_path / "c.pt", load_scaler=False)
    assert other.scaler.get_scale() == 8.0
    other.load_checkpoint(tmp_path / "c.pt")
    assert other.scaler.get_scale() == 65536.0


def test_rng_state_round_trip():
    import random

    import numpy as np
    state = T.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    T.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a



def test_load_checkpoint_primes_fused_sgd_again(tmp_path):
    model, _ = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    other_model, _ = fresh()
    unprimed = torch.optim.SGD(other_model.parameters(), lr=0.1, momentum=0.9, fused=True)
    other = T.Trainer(other_model, unprimed, T.TrainConfig(precision="bf16", progress=False))
    unprimed.state.clear()  # as saved by code that never primed: no buffers at all
    other.save_checkpoint(tmp_path / "before_any_step.pt")
    trainer.load_checkpoint(tmp_path / "before_any_step.pt")
    assert all(torch.count_nonzero(opt.state[p]["momentum_buffer"]) == 0
               for p in model.parameters())


# --- errors that say what a handler expects (issue 23) -------------------------------------------

def test_missing_and_folder_checkpoints_are_also_the_builtin_errors(tmp_path):
    trainer = trained()
    missing = tmp_path / "missing.pt"
    with pytest.raises(FileNotFoundError, match="missing.pt: no such checkpoint file"):
        trainer.load_checkpoint(missing)
    with pytest.raises(C.CheckpointError):  # still a CheckpointError, a ValueError
        trainer.load_checkpoint(missing)
    for call in (trainer.load_checkpoint, trainer.save_checkpoint):
        with pytest.raises(IsADirectoryError, match="is a folder"):
            call(tmp_path)
        with pytest.raises(ValueError, match="is a folder"):
            call(tmp_path)


def test_a_checkpoint_from_a_newer_release_says_so(tmp_path):
    trainer = trained()
    state = trainer.state_dict()
    state["format"] = "amp-lessons-trainer/3"
    C.atomic_save(state, tmp_path / "new.pt")
    before = live_tensors(trainer)
    with pytest.raises(C.CheckpointFromNewerRelease,
                       match=r"new.pt: written by a newer release of amp-lessons \(checkpoint "
                             r"format amp-lessons-trainer/3\); this release .* reads formats "
                             r"amp-lessons-trainer/1, amp-lessons-trainer/2"):
        trainer.load_checkpoint(tmp_path / "new.pt")
    assert_same_tensors(live_tensors(trainer), before)
    state["format"] = "someone-else/9"  # not our family: the usual message
    C.atomic_save(state, tmp_path / "other.pt")
    with pytest.raises(C.CheckpointError, match="not a checkpoint written by Trainer"):
        trainer.load_checkpoint(tmp_path / "other.pt")


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
