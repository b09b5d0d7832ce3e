"""Trainer._lean_step, the short path of ``train_step`` (issue 22, ninth session): one micro-batch
where nothing between backward and step needs the host. It must be the general path exactly:
same parameters, optimizer state, scaler and records, bitwise, under every policy it takes
(GradScaler, skip on the device or from the host, skip inside a fused kernel, ignore), with
skipped steps among them; a bad batch is refused and undone alike; and everything it does not
handle goes the general way."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.train import trainer as T
from trainer_helpers import TinyNet, optimizer_tensors

FIELDS = ("step", "epoch", "loss", "scale", "skipped", "grad_norm", "lr", "skip_reason")


def same_bits(a: dict, b: dict):
    """Every tensor of ``a`` and ``b`` bit for bit (NaN payloads too)."""
    assert a.keys() == b.keys()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        if x.is_floating_point():
            x, y = x.view(ints[x.element_size()]), y.view(ints[y.element_size()])
        assert torch.equal(x, y), k


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def data(n=8, bad=(2, 5)):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        if i in bad:  # a non-finite input: every gradient inf/NaN, the step skipped
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def fused_supported(kind) -> bool:
    try:
        p = nn.Parameter(torch.ones(2))
        opt = kind([p], lr=0.1, fused=True)
        p.grad = torch.ones(2)
        opt.step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}
CASES = [  # (precision, optimizer, config flags)
    ("fp16", "sgd", {}),
    ("fp16", "sgd", dict(track_grad_norm=False)),
    ("fp16", "sgd-fused", dict(track_grad_norm=False, track_time=False)),
    ("bf16", "sgd", dict(track_grad_norm=False)),  # skip: the host decides on a CPU ("auto")
    ("bf16", "sgd", dict(track_grad_norm=False, nonfused_skip="copy")),  # the device copy
    ("bf16", "adamw-fused", dict(track_grad_norm=False)),  # skipped inside the fused kernel
    ("bf16", "adamw", dict(track_grad_norm=False, nonfinite="ignore", track_time=False)),
]


def pair(precision, opt_name, flags):
    """Two trainers of the same model and settings: the lean path, and the general one."""
    made = []
    for lean in (True, False):
        model = mlp()
        cfg = T.TrainConfig(precision=precision, progress=False, seed=None, **flags)
        made.append(T.Trainer(model, OPTIMIZERS[opt_name](model.parameters()), cfg))
    lean, general = made
    general._lean = False
    return lean, general


@pytest.mark.parametrize("precision, opt_name, flags", CASES,
                         ids=[f"{p}-{o}-{'-'.join(f) or 'defaults'}" for p, o, f in CASES])
def test_the_lean_step_is_the_general_step_bitwise(precision, opt_name, flags):
    if opt_name.endswith("fused") and not fused_supported(
            torch.optim.SGD if opt_name.startswith("sgd") else torch.optim.AdamW):
        pytest.skip("no fused optimizer on this CPU build")
    lean, general = pair(precision, opt_name, flags)
    if flags.get("track_grad_norm", True):  # the norm needs the gradients: the general path
        assert not lean._lean
        return
    assert lean._lean
    taken = []
    original = lean._lean_step
    lean._lean_step = lambda *args: taken.append(1) or original(*args)
    for x, y in data():
        a, b = lean.train_step([(x, y)]), general.train_step([(x, y)])
        for field in FIELDS:
            va, vb = getattr(a, field), getattr(b, field)
            assert va == vb or (va != va and vb != vb), (field, va, vb)  # NaN equals NaN here
        assert (a.time_s is None) == (b.time_s is None)
    assert len(taken) == 8
    assert [r.skipped for r in lean.history] == [False, False, True, False, False, True, False,
                                                 False] or flags.get("nonfinite") == "ignore"
    same_bits(lean.model.state_dict(), general.model.state_dict())
    same_bits(optimizer_tensors(lean.optimizer), optimizer_tensors(general.optimizer))
    assert lean.scaler.state_dict() == general.scaler.state_dict()
    assert (lean.step, lean.epoch) == (general.step, general.epoch) == (8, 0)


def test_a_bad_batch_is_refused_and_undone_as_in_the_general_path():
    lean, general = pair("fp16", "sgd", dict(track_grad_norm=False))
    x, y = data(1, bad=())[0]
    for trainer in (lean, general):
        trainer.train_step([(x, y)])
    messages = []
    for trainer in (lean, general):
        with pytest.raises(ValueError) as err:
            trainer.train_step([(x,)])
        messages.append(str(err.value))
        assert all(p.grad is None for p in trainer.model.parameters())
        assert trainer.step == 1 and trainer._phase == T._IDLE
    assert messages[0] == messages[1] and "micro-batch 0 is a tuple of length 1" in messages[0]

    class Boom(nn.Module):  # fails in the forward pass, after the batch was taken
        def forward(self, x):
            raise RuntimeError("boom")

    lean.loss_fn = lambda out, y: F.cross_entropy(out, y)
    saved = lean.model
    lean.model = nn.Sequential(saved, Boom())
    with pytest.raises(RuntimeError, match="boom"):
        lean.train_step([(x, y)])
    assert lean.step == 1 and lean._phase == T._IDLE
    lean.model = saved
    assert lean.train_step([(x, y)]).step == 1  # and the trainer goes on


@pytest.mark.parametrize("why, kwargs", [
    ("BatchNorm's guard", dict(model=TinyNet)),
    ("a hook between backward and step", dict(hooks=True)),
    ("clipping", dict(flags=dict(clip_norm=1.0))),
    ("clipping by value", dict(flags=dict(clip_value=1.0))),
    ("the gradient norm", dict(flags=dict(track_grad_norm=True))),
    ("nonfinite='raise'", dict(flags=dict(nonfinite="raise"), precision="bf16")),
    ("fp32's TF32 settings", dict(precision="fp32")),
])
def test_what_the_lean_step_does_not_handle_goes_the_general_way(why, kwargs):
    class BeforeStep(T.Hooks):
        def before_step(self, trainer):
            pass

    model = kwargs.get("model", mlp)()
    flags = dict(dict(track_grad_norm=False), **kwargs.get("flags", {}))
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                        T.TrainConfig(precision=kwargs.get("precision", "fp16"), progress=False,
                                      **flags),
                        hooks=[BeforeStep()] if kwargs.get("hooks") else None)
    assert not trainer._lean, why


def test_a_scheduler_or_several_micro_batches_take_the_general_path():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False,
                                                  track_grad_norm=False))
    assert trainer._lean
    trainer._lean_step = lambda *args: pytest.fail("the lean step took what it must not")
    (x, y), (x2, y2) = data(2, bad=())
    trainer.train_step([(x, y), (x2, y2)])
    trainer.scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    trainer.train_step([(x, y)])
    assert trainer.step == 2


def _package_opcodes_per_step(trainer, x, y) -> int:
    """Bytecode instructions the trainer's own code (``amp_lessons``) executes in one step: the
    Python a short step pays for, counted exactly (a timing on this CPU cannot resolve it)."""
    import os
    import sys
    package = os.path.dirname(T.__file__)
    count = [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    for _ in range(3):
        trainer.train_step([(x, y)])
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        trainer.train_step([(x, y)])
    finally:
        sys.settrace(previous)
    return count[0]


def test_the_lean_step_runs_less_of_the_trainers_python():
    """fp16, SGD with momentum, no grad norm, memory or time record: 526 instructions of the
    trainer's code a step on the lean path against 621 on the general one (Python 3.11); on the
    H200's host each instruction of a short step is paid (benchmarks/NOTES.md, ninth session)."""
    x, y = data(1, bad=())[0]
    lean, general = pair("fp16", "sgd", dict(track_grad_norm=False, track_memory=False,
                                              track_time=False))
    a, b = _package_opcodes_per_step(lean, x, y), _package_opcodes_per_step(general, x, y)
    assert a <= 0.87 * b and a <= 560, (a, b)


def test_the_figures_notes_quotes_are_the_committed_h200_results():
    """NOTES.md's ninth-session table of the lean step is the committed H200 run's."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    doc = json.loads((root / "benchmarks" / "results" / "trainer_overhead_h200_lean_step.json")
                     .read_text())
    rows = {(n, r["variant"], r["reference"]): r for n, net in doc["networks"].items()
            for r in net["rows"]}

    def cost(network, variant, reference="hand-written"):
        r = rows[(network, variant, reference)]
        return f"{r['cost_pct']:+.2f}% [{r['cost_ci95_pct'][0]:+.2f}, {r['cost_ci95_pct'][1]:+.2f}]"

    notes = (root / "benchmarks" / "NOTES.md").read_text()
    for quoted in (f"**{cost('recipe', 'trainer, lean')[:6]}** {cost('recipe', 'trainer, lean')[7:]}",
                   cost("recipe", "trainer, lean", "hand-written, one function"),
                   cost("recipe", "trainer, defaults"), cost("mlp_bf16", "trainer, lean"),
                   cost("mlp_bf16", "trainer, lean", "hand-written, skip via found_inf")[7:],
                   cost("recipe", "trainer lean, CUDA graph", "hand-written, CUDA graph")[7:]):
        assert quoted in notes, quoted
    assert all(r["bitwise_equal_to_reference"] for k, r in rows.items() if "graph" not in k[1])
    assert [round(doc["networks"][n]["noise_floor_pct"], 2) for n in ("recipe", "mlp_bf16")] == \
        [2.15, 2.57]
    checks = json.loads((root / "benchmarks" / "results" / "trainer_overhead_h200_lean_checks.json")
                        .read_text())["gpu_checks"]
    lean = {k: v for part in ("skip", "no_sync") for k, v in checks[part].items() if "lean" in k}
    assert len(lean) == 7 and all(v["ok"] for v in lean.values())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("where", ["module hook", "tensor hook", "loss_fn"])
def test_cancel_step_from_outside_the_hooks_cancels_on_both_paths(precision, where):
    """``cancel_step`` needs only a step in progress: a module's forward hook or the loss
    function may call it. The lean step ignored it and stepped (found by a review)."""
    lean, general = pair(precision, "sgd", dict(track_grad_norm=False))
    assert lean._lean
    for trainer in (lean, general):
        if where == "module hook":
            trainer.model[0].register_forward_hook(
                lambda *args, t=trainer: t.cancel_step("watchdog") if t.step == 1 else None)
        elif where == "tensor hook":  # runs during backward, on the first layer's gradient
            trainer.model[0].weight.register_hook(
                lambda grad, t=trainer: t.cancel_step("watchdog") if t.step == 1 else None)
        else:
            trainer.loss_fn = lambda out, y, t=trainer: (
                t.cancel_step("watchdog") if t.step == 1 else None) or F.cross_entropy(out, y)
    for x, y in data(3, bad=()):
        a, b = lean.train_step([(x, y)]), general.train_step([(x, y)])
        assert (a.skipped, a.skip_reason, a.scale, a.loss) == (b.skipped, b.skip_reason, b.scale,
                                                               b.loss)
        assert lean._clock.last is None or a.step != 1  # a cancelled step breaks the chain
    assert [r.skip_reason for r in lean.history] == [None, "watchdog", None]
    same_bits(lean.model.state_dict(), general.model.state_dict())
    same_bits(optimizer_tensors(lean.optimizer), optimizer_tensors(general.optimizer))
    assert lean.scaler.state_dict() == general.scaler.state_dict()


def test_a_mapping_of_micro_batches_is_refused_on_both_paths():
    """``{0: (x, y)}`` indexes like a list but iterates its keys: the general path refuses it,
    and the lean step must not train on it (it did: routing read ``micro_batches[0]``)."""
    lean, general = pair("fp16", "sgd", dict(track_grad_norm=False))
    x, y = data(1, bad=())[0]
    for trainer in (lean, general):
        with pytest.raises(ValueError, match="micro-batch 0 is a int"):
            trainer.train_step({0: (x, y)})
        assert trainer.step == 0 and not trainer.history


def test_the_capture_modes_notes_describes_are_the_committed_runs():
    """NOTES.md (ninth session): over the seven committed paired runs on the recipe network the
    hand-captured step is bimodal, lean's graph follows it and the defaults' graph does not."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    runs = ("balanced", "host_cpu", "issue22", "issue22_rerun", "norm_after_step", "recipe_ninth",
            "lean_step")
    fast, slow = [], []
    for run in runs:
        rows = {r["variant"]: r for r in json.loads(
            (root / "benchmarks" / "results" / f"trainer_overhead_h200_{run}.json").read_text()
        )["networks"]["recipe"]["rows"]}
        hand = rows["hand-written, CUDA graph"]["step_ms"]
        lean, defaults = rows["trainer lean, CUDA graph"], rows["trainer defaults, CUDA graph"]
        (fast if hand < 1.0 else slow).append((hand, lean["step_ms"], defaults["step_ms"],
                                               lean["cost_pct"], lean["cost_ci95_pct"][1]))
    assert (len(fast), len(slow)) == (3, 4)
    assert 0.957 <= min(f[0] for f in fast) and max(f[0] for f in fast) < 0.9725
    assert 1.0725 <= min(s[0] for s in slow) and max(s[0] for s in slow) < 1.0795
    assert all(1.0655 <= r[2] < 1.0785 for r in fast + slow)  # the defaults' graph: one mode
    assert all(r[4] > 3.0 for r in fast) and all(r[4] < 3.0 for r in slow)  # the goal's verdict
    notes = (root / "benchmarks" / "NOTES.md").read_text()
    assert "is bimodal**. It took 0.957-0.972 ms in three runs and 1.073-1.079 ms in four." in notes
