"""Lesson 08's optimizers save and load everything that decides their next step (issue 41, class
1): a resume through ``state_dict`` or through the Trainer's checkpoint is bitwise the straight
run, the stochastic-rounding generator included; a state of another kind is refused before
anything changes; a failed load leaves the optimizer exactly as it was; an optimizer with
nothing to train is refused."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.measure import BenchConfig
from amp_lessons.measure.config import OPTIMIZER_IMPLS, OPTIMIZERS
from amp_lessons.measure.steps import build_optimizer as bench_optimizer
from amp_lessons.measure import optim as O
from amp_lessons.train import checkpoint as C
from amp_lessons.train import trainer as T

ROUNDINGS = ("nearest", "stochastic", "kahan")


def params(seed=0, n=256):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(n, generator=g) * 3).to(torch.bfloat16)),
            nn.Parameter(torch.randn(4, 8, generator=g).to(torch.bfloat16))]


def grads(step, ps):
    g = torch.Generator().manual_seed(1000 + step)
    for p in ps:
        # small gradients: many updates fall below bf16's half ulp, where rounding decides
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)


def run(opt, ps, steps, start=0):
    for s in range(start, start + steps):
        grads(s, ps)
        opt.step()
    return [p.detach().clone() for p in ps]


def through_file(state):
    """``state`` saved and read back as a checkpoint is (``weights_only=True``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(opt):
    """Everything about ``opt`` a load could change, copied."""
    return {"defaults": copy.deepcopy(opt.defaults),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "group_params": [[id(p) for p in g["params"]] for g in opt.param_groups],
            "state": {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in s.items()} for p, s in opt.state.items()},
            "generators": {str(d): g.get_state() for d, g in opt._generators.items()},
            "seed": opt.seed, "rounding": opt.rounding}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# --- resume ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("split", [0, 1, 7])
def test_a_resume_through_state_dict_is_bitwise_the_straight_run(rounding, split):
    ps = params()
    straight = run(O.BF16AdamW(ps, lr=1e-3, rounding=rounding, seed=5), ps, 12)
    ps = params()
    first = O.BF16AdamW(ps, lr=1e-3, rounding=rounding, seed=5)
    run(first, ps, split)
    saved = through_file(first.state_dict())
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    torch.manual_seed(99)  # the global generator is not the optimizer's
    second = O.BF16AdamW(ps2, lr=1e-3, rounding=rounding, seed=0)  # the seed comes from the file
    second.load_state_dict(saved)
    resumed = run(second, ps2, 12 - split, start=split)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_the_stochastic_resume_needs_the_generator_state():
    """The control: a resume that starts the generator again from its seed (what the state dict
    held before) is not the straight run; so the test above can fail."""
    ps = params()
    straight = run(O.BF16AdamW(ps, rounding="stochastic", seed=5), ps, 10)
    ps = params()
    first = O.BF16AdamW(ps, rounding="stochastic", seed=5)
    run(first, ps, 5)
    saved = through_file(first.state_dict())
    saved[O.STATE_KEY]["generators"] = {}  # as if the generator had not been saved
    second = O.BF16AdamW(ps, rounding="stochastic", seed=5)
    second.load_state_dict(saved)
    resumed = run(second, ps, 5, start=5)
    assert sum(int((a != b).sum()) for a, b in zip(straight, resumed)) > 10


def test_one_state_dict_loads_into_two_optimizers_without_sharing_tensors():
    ps = params()
    first = O.BF16AdamW(ps, rounding="kahan")
    run(first, ps, 3)
    saved = through_file(first.state_dict())
    pa = [nn.Parameter(p.detach().clone()) for p in ps]
    pb = [nn.Parameter(p.detach().clone()) for p in ps]
    a, b = O.BF16AdamW(pa, rounding="kahan"), O.BF16AdamW(pb, rounding="kahan")
    a.load_state_dict(saved)
    b.load_state_dict(saved)
    ra, rb = run(a, pa, 3, start=3), run(b, pb, 3, start=3)
    for x, y in zip(ra, rb):
        assert torch.equal(x, y)


def test_a_successful_load_keeps_the_settings_bf16adamw_has():
    ps = params()
    opt = O.BF16AdamW(ps, lr=2e-3)
    run(opt, ps, 2)
    before = dict(opt.defaults)
    opt.load_state_dict(through_file(opt.state_dict()))
    assert opt.defaults == before and "differentiable" not in opt.defaults
    assert all("differentiable" not in g for g in opt.param_groups)


def bf16_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g).to(torch.bfloat16),
             torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def bf16_trainer(rounding, seed=0):
    model = bf16_model(seed)
    opt = O.BF16AdamW(model.parameters(), lr=1e-3, rounding=rounding, seed=3)
    return T.Trainer(model, opt, T.TrainConfig(precision="fp32", progress=False),
                     loss_fn=lambda out, y: F.cross_entropy(out.float(), y))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_trainer_with_bf16adamw_resumes_its_checkpoint_bitwise(tmp_path, rounding):
    batches = data()
    whole = bf16_trainer(rounding)
    whole.fit(batches, epochs=1)
    first = bf16_trainer(rounding)
    first.fit(batches, epochs=1, max_steps=3)
    path = first.save_checkpoint(tmp_path / "c.pt")
    first.load_checkpoint(path)  # into itself: the first example
    second = bf16_trainer(rounding, seed=1)  # other weights: all must come from the file
    second.load_checkpoint(path)
    second.fit(batches, epochs=1)
    assert second.step == whole.step == 8
    for a, b in zip(second.model.parameters(), whole.model.parameters()):
        assert torch.equal(a, b)
    a, b = second.optimizer.state_dict(), whole.optimizer.state_dict()
    assert_same(a["state"], b["state"])
    assert_same(a[O.STATE_KEY], b[O.STATE_KEY])


def test_a_trainer_refuses_a_checkpoint_of_another_rounding_and_changes_nothing(tmp_path):
    kahan = bf16_trainer("kahan")
    kahan.fit(data(2), epochs=1)
    stochastic = bf16_trainer("stochastic")
    stochastic.fit(data(2), epochs=1)
    path = stochastic.save_checkpoint(tmp_path / "s.pt")
    before = snapshot(kahan.optimizer)
    weights = [p.detach().clone() for p in kahan.model.parameters()]
    with pytest.raises(C.CheckpointError, match="rounding='stochastic'.*rounding='kahan'"):
        kahan.load_checkpoint(path)
    assert_same(snapshot(kahan.optimizer), before)
    assert all(torch.equal(a, b) for a, b in zip(kahan.model.parameters(), weights))


def test_the_load_check_leaves_the_live_optimizers_settings_alone():
    """The issue's cause: the check loaded into a copy that shared the settings dict, and
    torch's load added 'differentiable' to the live optimizer's."""
    ps = params()
    opt = O.BF16AdamW(ps)
    run(opt, ps, 1)
    before = snapshot(opt)
    C.check_optimizer_state(through_file(opt.state_dict()), opt)
    assert_same(snapshot(opt), before)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    sgd_groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                for g in sgd.param_groups])
    with pytest.raises(C.CheckpointError):
        C.check_optimizer_state(through_file(opt.state_dict()), sgd)
    assert [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups] == sgd_groups


# --- refusals ------------------------------------------------------------------------------------

def kahan_after(steps=2):
    ps = params()
    opt = O.BF16AdamW(ps, rounding="kahan", seed=1)
    run(opt, ps, steps)
    return opt, ps


def other_states():
    """State dicts a Kahan BF16AdamW over ``params()`` must refuse: (name, state, message)."""
    ps = params()
    adamw = torch.optim.AdamW(ps)
    run(adamw, ps, 1)
    out = [("torch AdamW", adamw.state_dict(), "not a BF16AdamW state")]
    for rounding in ("stochastic", "nearest"):
        ps = params()
        o = O.BF16AdamW(ps, rounding=rounding)
        run(o, ps, 1)
        out.append((rounding, o.state_dict(), f"rounding='{rounding}'"))
    good, _ = kahan_after(1)
    base = through_file(good.state_dict())

    def changed(fn):
        s = copy.deepcopy(base)
        fn(s)
        return s

    out += [
        ("no compensation", changed(lambda s: s["state"][0].pop("compensation")),
         "keeps \\['compensation'"),
        ("a moment of another shape", changed(
            lambda s: s["state"][0].__setitem__("exp_avg", torch.zeros(3, dtype=torch.bfloat16))),
         "exp_avg is \\(3,\\)"),
        ("a moment in fp32", changed(
            lambda s: s["state"][1].__setitem__("exp_avg_sq", torch.zeros(4, 8))),
         "exp_avg_sq is \\(4, 8\\) torch.float32"),
        ("a tensor step", changed(lambda s: s["state"][0].__setitem__("step", torch.tensor(1.))),
         "has step"),
        ("a negative lr", changed(lambda s: s["param_groups"][0].__setitem__("lr", -1.0)),
         "param group 0: lr must be"),
        ("beta of 1", changed(lambda s: s["param_groups"][0].__setitem__("betas", (0.9, 1.0))),
         "betas"),
        ("a NaN eps", changed(lambda s: s["param_groups"][0].__setitem__("eps", float("nan"))),
         "eps must be"),
        ("a junk generator", changed(lambda s: s[O.STATE_KEY]["generators"].__setitem__(
            "cpu", torch.zeros(3, dtype=torch.uint8))), "generator of device 'cpu'"),
        ("a generator of a device that is not here", changed(
            lambda s: s[O.STATE_KEY]["generators"].__setitem__("nodevice", torch.zeros(3))),
         "generator of device 'nodevice'"),
        ("a seed below 0", changed(lambda s: s[O.STATE_KEY].__setitem__("seed", -1)), "seed"),
        ("one group too many", changed(lambda s: s["param_groups"].append(
            dict(s["param_groups"][0], params=[7]))), "2 param groups"),
        ("state of a parameter no group holds", changed(
            lambda s: s["state"].__setitem__(9, s["state"][0])), "parameter 9"),
        ("not a dict", [1, 2], "not an optimizer state"),
    ]
    return out


@pytest.mark.parametrize("case", other_states(), ids=lambda c: c[0])
def test_a_state_of_another_kind_is_refused_before_anything_changes(case):
    name, state, message = case
    opt, ps = kahan_after()
    twin, twin_ps = kahan_after()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    assert_same(snapshot(opt), before)
    # and it steps as if the load had never been tried
    for a, b in zip(run(opt, ps, 2, start=2), run(twin, twin_ps, 2, start=2)):
        assert torch.equal(a, b)


def test_a_load_that_fails_inside_torch_leaves_the_optimizer_exactly_as_it_was():
    opt, ps = kahan_after()
    good = through_file(opt.state_dict())
    run(opt, ps, 1, start=2)  # now different from ``good``
    before = snapshot(opt)

    def refuse(optimizer):
        raise RuntimeError("a post-hook that fails")

    opt.register_load_state_dict_post_hook(refuse)
    with pytest.raises(RuntimeError, match="post-hook"):
        opt.load_state_dict(good)
    assert_same(snapshot(opt), before)
    assert "differentiable" not in opt.defaults


@pytest.mark.parametrize("groups", [[{"params": []}], [{"params": []}, {"params": params()}],
                                    [{"params": params()}, {"params": ()}]])
def test_an_optimizer_with_nothing_to_train_in_a_group_is_refused(groups):
    with pytest.raises(ValueError, match="holds no tensor; BF16AdamW needs at least one"):
        O.BF16AdamW(groups)


def test_an_empty_param_group_added_later_is_refused_and_not_added():
    opt = O.BF16AdamW(params())
    with pytest.raises(ValueError, match="param group 1 holds no tensor"):
        opt.add_param_group({"params": []})
    with pytest.raises(ValueError, match="param group 1 holds no tensor"):
        opt.add_param_group({"params": iter([])})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="empty parameter list"):
        O.BF16AdamW([])


@pytest.mark.parametrize("seed", [-1, 2 ** 63, 1.5, True])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(ValueError, match="seed must be"):
        O.BF16AdamW(params(), seed=seed)


# --- every optimizer the course ships --------------------------------------------------------

def _course_optimizers():
    """(name, build(params) -> optimizer, param dtype) for each optimizer the course builds on
    a CPU: lesson 08's recipes (torchao's need CUDA) and the engine's configurations."""
    out = []
    for name, recipe in O.RECIPES.items():
        if recipe.needs_torchao:
            continue
        dtype = torch.bfloat16 if recipe.needs_bf16 else torch.float32
        out.append((f"recipe {name}", lambda ps, r=recipe: O.build_optimizer(r, ps, 1e-3, seed=2),
                    dtype))
    for optimizer in OPTIMIZERS:
        for impl in OPTIMIZER_IMPLS:
            cfg = BenchConfig(optimizer=optimizer, impl=impl)
            out.append((f"bench {optimizer} {impl}",
                        lambda ps, c=cfg: bench_optimizer(c, ps), torch.float32))
    return out


@pytest.mark.parametrize("case", _course_optimizers(), ids=lambda c: c[0])
def test_every_optimizer_the_course_ships_resumes_bitwise(case):
    _, build, dtype = case

    def fresh_params():
        return [nn.Parameter(p.detach().to(dtype)) for p in params(n=64)]

    ps = fresh_params()
    straight = run(build(ps), ps, 6)
    ps = fresh_params()
    first = build(ps)
    run(first, ps, 3)
    saved = through_file(first.state_dict())
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    second = build(ps2)
    second.load_state_dict(saved)
    for a, b in zip(straight, run(second, ps2, 3, start=3)):
        assert torch.equal(a, b)
