"""Lesson 08 (weights and optimizer state): the engine's bf16 optimizer, rounding and counters
(amp_lessons/measure/optim.py), the lesson's workloads and tables, and its figures; fast, on the CPU."""
import math

import pytest
import torch
from torch import nn

from amp_lessons.numerics import formats
from amp_lessons.measure import optim
from amp_lessons.lessons import l08_weights as L
from amp_lessons.ui import weight_plots as WP
import torch.nn.functional as F


# --- formats.ulp ---------------------------------------------------------------------------------

def test_ulp_is_the_gap_to_the_next_value():
    assert formats.ulp(1.0, "bf16") == 2 ** -7
    assert formats.ulp(1.0, "fp32") == 2 ** -23
    assert formats.ulp(-3.0, "fp16") == 2 ** -9
    assert formats.ulp(0.0, "bf16") == 2.0 ** (-126 - 7)  # the smallest subnormal
    w = torch.tensor(1.0, dtype=torch.bfloat16)
    assert float(w + formats.ulp(1.0, "bf16")) > 1.0
    assert float(w + 0.49 * formats.ulp(1.0, "bf16")) == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1", True, 1e39])
def test_ulp_rejects_what_is_not_a_number_in_range(bad):
    with pytest.raises(ValueError, match="x must"):
        formats.ulp(bad, "bf16" if bad != 1e39 else "fp16")


# --- rounding --------------------------------------------------------------------------------------

def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.full((20000,), 1.0 + 0.25 * 2 ** -7)  # a quarter of the way to the next bf16 value
    r = optim.stochastic_round_bf16(x, g).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float((r > 1).float().mean()) - 0.25) < 0.02
    neg = optim.stochastic_round_bf16(-x, g).float()
    assert abs(float(neg.mean()) + float(x[0])) < 2e-4
    exact = torch.tensor([1.5, -2.0, 0.0, math.inf])
    assert torch.equal(optim.stochastic_round_bf16(exact, g).float(), exact)
    with pytest.raises(ValueError, match="x must be a float32 tensor"):
        optim.stochastic_round_bf16(x.double())


def test_round_to_nearest_loses_small_updates_and_kahan_keeps_them():
    assert optim.accumulate_bf16(1e-3, 200, 1.0, "nearest")[-1] == 1.0
    assert optim.accumulate_bf16(1e-3, 1000, 1.0, "kahan")[-1] == 2.0
    sr = optim.accumulate_bf16(1e-3, 1000, 1.0, "stochastic", seed=1)[-1]
    assert 1.6 < sr < 2.4
    with pytest.raises(ValueError, match="rounding must be one of"):
        optim.accumulate_bf16(1e-3, 10, 1.0, "up")
    with pytest.raises(ValueError, match="compensation"):
        optim.add_rounded(torch.ones(2, dtype=torch.bfloat16), torch.ones(2), "kahan")


def _fit(opt_factory, dtype, steps=300, lr=1e-4):
    torch.manual_seed(0)
    target = torch.randn(64) * 0.1 + 1.0
    w = nn.Parameter(torch.ones(64, dtype=dtype))
    opt = opt_factory([w], lr)
    for _ in range(steps):
        loss = ((w.float() - target) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return w.detach().float(), target


def test_bf16_adamw_kahan_follows_fp32_adamw_where_nearest_stalls():
    kw = dict(betas=(0.9, 0.999), weight_decay=0.0)
    ref, target = _fit(lambda p, lr: torch.optim.AdamW(p, lr=lr, **kw), torch.float32)
    near, _ = _fit(lambda p, lr: optim.BF16AdamW(p, lr=lr, rounding="nearest", **kw), torch.bfloat16)
    kahan, _ = _fit(lambda p, lr: optim.BF16AdamW(p, lr=lr, rounding="kahan", **kw), torch.bfloat16)
    sr, _ = _fit(lambda p, lr: optim.BF16AdamW(p, lr=lr, rounding="stochastic", **kw),
                 torch.bfloat16)
    assert torch.equal(near, torch.ones(64))  # lr 1e-4 < half an ulp of 1: nothing moves
    assert (kahan - ref).abs().max() < 2 ** -7   # within one bf16 ulp of fp32 AdamW
    assert (sr - ref).abs().mean() < 2 ** -7
    assert (ref - 1).abs().mean() > 0.01


def test_bf16_adamw_checks_its_settings():
    p = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="params must be bfloat16"):
        optim.BF16AdamW([nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="rounding must be one of"):
        optim.BF16AdamW(p, rounding="down")
    with pytest.raises(ValueError, match="betas"):
        optim.BF16AdamW(p, betas=(0.9,))
    with pytest.raises(ValueError, match="lr"):
        optim.BF16AdamW(p, lr=-1.0)


def test_bf16_adamw_kahan_state_and_set_lr():
    p = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = optim.BF16AdamW([p], lr=1e-3, rounding="kahan")
    p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "compensation"}
    assert optim.state_bytes(opt) == 3 * 8 * 2
    optim.set_lr(opt, 5e-4)
    assert opt.param_groups[0]["lr"] == 5e-4
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    optim.set_lr(opt, 2e-4)
    assert abs(float(opt.param_groups[0]["lr"]) - 2e-4) < 1e-9
    with pytest.raises(ValueError, match="lr"):
        optim.set_lr(opt, -1)


def test_rounded_away_counts_weights_left_unchanged_by_a_nonzero_gradient():
    lost = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    moved = nn.Parameter(torch.ones(4))
    counter = optim.RoundedAway([lost, moved])
    with pytest.raises(ValueError, match="before"):
        counter.share()
    lost.grad, moved.grad = torch.ones(4, dtype=torch.bfloat16), torch.tensor([1.0, 1, 0, 0])
    counter.before()
    with torch.no_grad():
        lost.add_(1e-4)     # below half an ulp of 1 in bf16: rounded away
        moved.add_(1e-4)
    assert float(counter.share()) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="params"):
        optim.RoundedAway([])


def test_state_bytes_of_torch_adamw():
    p = nn.Parameter(torch.ones(10, 10))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert optim.state_bytes(opt) == 2 * 100 * 4 + 4  # two fp32 moments and a step counter


def test_state_bytes_counts_torchao_subclasses_by_their_codes():
    ao = pytest.importorskip("torchao.optim")
    p = nn.Parameter(torch.ones(64, 128))
    opt = ao.AdamW8bit([p])
    opt.state[p]["exp_avg"] = opt._new_buffer(p, True)
    assert optim.state_bytes(opt) < 64 * 128 * 2


# --- recipes ---------------------------------------------------------------------------------------

def _mlp_workload(steps=8):
    return L.teacher_student(16, 32, steps, "cpu", lr=1e-3, depth=2)


def test_train_recipe_trains_counts_and_measures_on_the_cpu():
    w = _mlp_workload()
    rows = {n: optim.train_recipe(optim.get_recipe(n), w.make_model, w.batch, w.loss_fn, w.steps,
                                  w.lr_at, "cpu", time_steps_n=6)
            for n in ("fp32 master", "bf16", "bf16 + Kahan")}
    for name, r in rows.items():
        assert r["status"] == "trained" and len(r["losses"]) == 8, name
        assert len(r["rounded_away"]) == 8 and r["step_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["optimizer_spread"] >= 0 and r["step_spread"] >= 0  # 3 repeats of 2 steps
        assert r["peak_mib"] is None and r["activations_mib"] > 0
    mem = {m["recipe"]: m for m in optim.memory_rows(list(rows.values()))}
    assert mem["fp32 master"]["bytes per parameter"] == pytest.approx(16, abs=0.05)
    assert mem["bf16"]["bytes per parameter"] == pytest.approx(8, abs=0.05)
    assert mem["bf16 + Kahan"]["bytes per parameter"] == pytest.approx(10, abs=0.05)
    # the same seed and data: the bf16 model starts from the reference's weights, rounded
    assert rows["bf16"]["losses"][0] == pytest.approx(rows["fp32 master"]["losses"][0], rel=0.05)


def test_train_recipe_says_why_it_did_not_run_and_reports_failures():
    w = _mlp_workload(2)
    args = (w.make_model, w.batch, w.loss_fn, 2, w.lr_at, "cpu")
    r = optim.train_recipe(optim.get_recipe("8-bit state"), *args, torchao=None)
    assert r["status"] == "not run: torchao not installed"
    r = optim.train_recipe(optim.get_recipe("8-bit state"), *args, torchao="0.18")
    assert r["status"] == "not run: torchao's low-bit optimizers run on CUDA GPUs"
    r = optim.train_recipe(optim.get_recipe("bf16"), *args, bf16=False)
    assert r["status"] == "not run: no native bf16 on this GPU"

    def oom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken():
        raise KeyError("boom")
    r = optim.train_recipe(optim.get_recipe("fp32 master"), oom, *args[1:])
    assert r["status"] == "out of memory"
    r = optim.train_recipe(optim.get_recipe("fp32 master"), broken, *args[1:])
    assert r["status"].startswith("error: KeyError")
    with pytest.raises(ValueError, match="recipe must be one of"):
        optim.get_recipe("fp64")
    with pytest.raises(ValueError, match="steps"):
        optim.train_recipe(optim.get_recipe("bf16"), w.make_model, w.batch, w.loss_fn, 0,
                           w.lr_at, "cpu")


# --- the lesson ------------------------------------------------------------------------------------

def test_one_weight_and_accumulation_tables():
    rows = {r["update"]: r for r in L.one_weight(1.0)}
    assert rows[1e-3]["half ulp"] == 2 ** -8 and not rows[1e-3]["update kept"]
    assert rows[1e-2]["update kept"]
    acc = {r["rounding"]: r for r in L.accumulation_rows(1e-3, 100, 1.0, seeds=(0, 1))}
    assert acc["nearest"]["update applied %"] == 0 and acc["stochastic"]["runs"] == 2
    assert acc["kahan"]["final (mean)"] == pytest.approx(1.1, abs=2 ** -7)


def test_cosine_lr():
    at = L.cosine_lr(1e-3, 100, warmup=10)
    assert at(0) == pytest.approx(1e-4) and at(9) == pytest.approx(1e-3)
    assert at(99) == pytest.approx(1e-4) and at(10) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="floor"):
        L.cosine_lr(1e-3, 10, floor=2.0)


def _row(workload, recipe, seed, final, shares=(), status="trained", **extra):
    losses = [1.0] * 9 + [final]
    r = {"workload": workload, "recipe": recipe, "seed": seed, "final_loss": final,
         "losses": losses, "rounded_away": list(enumerate(shares)) if shares else
         [(9, 0.0)], "status": status}
    r.update(extra)
    return r


def _fake_rows():
    return [_row("mlp", "fp32 master", 0, 1.00, [0.0] * 10),
            _row("mlp", "fp32 master", 1, 1.02),
            _row("mlp", "bf16", 0, 1.20, [0.9] * 10),
            _row("mlp", "bf16 + Kahan", 0, 1.01, [0.8] * 10),
            {**_row("mlp", "8-bit state", 0, None), "status": "not run: torchao not installed",
             "losses": [], "rounded_away": []}]


def test_comparison_puts_each_recipe_beside_the_reference_and_its_spread():
    table = {t["recipe"]: t for t in L.comparison(_fake_rows())}
    assert len(table) == 4  # the reference once, with its first seed
    assert table["bf16"]["difference %"] == pytest.approx(20)
    assert table["bf16"]["reference spread %"] == pytest.approx(2)
    assert table["bf16"]["within spread"] is False and table["bf16 + Kahan"]["within spread"]
    assert table["bf16"]["rounded away % (last 10%)"] == pytest.approx(90)
    assert table["8-bit state"]["final loss"] is None
    line = L.stall_line(list(table.values()))
    assert "the stall shows" in line and "+20.0%" in line and "bf16 + Kahan: +1.0%" in line
    assert L.skipped_line(_fake_rows()) == "skipped 8-bit state: torchao not installed"


def _fake_memory():
    def m(recipe, w, g, s, a, params=2 ** 20):  # MiB per 2**20 parameters = bytes per parameter
        mib = 2 ** 20
        return {"workload": "mlp", "recipe": recipe, "weights MiB": w, "gradients MiB": g,
                "optimizer state MiB": s, "activations MiB": a, "total MiB": w + g + s + a,
                "bytes per parameter": (w + g + s) * mib / params}
    return [m("fp32 master", 4, 4, 8, 4), m("bf16", 2, 2, 4, 4), m("bf16 + Kahan", 2, 2, 6, 4),
            m("8-bit state", 4, 4, 2, 4)]


def test_per_rank_rows_shard_against_shrink():
    rows = {(r["setup"], r["GPUs"]): r for r in L.per_rank_rows(_fake_memory(), ranks=(2, 4))}
    assert rows[("fp32 master, one GPU", 1)]["saved per rank %"] == 0
    assert rows[("fp32 master + ZeRO-1", 4)]["total MiB per rank"] == 4 + 4 + 2 + 4
    assert rows[("8-bit state, one GPU", 1)]["saved per rank %"] == pytest.approx(30)
    assert rows[("8-bit state + ZeRO-1", 4)]["optimizer state MiB per rank"] == 0.5
    line = L.r10c_line(L.per_rank_rows(_fake_memory(), ranks=(2, 4)))
    assert "lesson 06" in line and "ZeRO-1 over 4 GPUs saves 30%" in line
    assert L.per_rank_rows([]) == []


def test_choice_table_picks_the_closest_recipe_that_fits():
    table = L.comparison(_fake_rows())
    cards = (("small", 16 * 1000 * 3 / 2 ** 30, True), ("small, no bf16", 16 * 1000 * 3 / 2 ** 30, False),
             ("big", 1.0, True))
    rows = L.choice_table(table, _fake_memory(), cards=cards, sizes=(1000, 10 ** 9), state_share=0.5)
    # 1000 params: fp32 master takes 16 kB; half of the small card holds 24 kB
    assert rows[0]["small"].startswith("fp32 master") and rows[0]["big"].startswith("fp32 master")
    # 1e9 params: 16 GB, nothing fits the small card; the big card (0.5 GiB) holds none either
    assert rows[1]["small"] == "shard it (lesson 06)"
    tight = (("tight", 16 * 1000 * 1.5 / 2 ** 30, True), ("tight, no bf16", 16 * 1000 * 1.5 / 2 ** 30, False))
    pick = L.choice_table(table, _fake_memory(), cards=tight, sizes=(1000,), state_share=0.5)[0]
    assert pick["tight"].startswith("bf16 + Kahan") and pick["tight, no bf16"] == "shard it (lesson 06)"
    with pytest.raises(ValueError, match="state_share"):
        L.choice_table(table, _fake_memory(), state_share=0)


def test_report_rows_show_times_only_from_a_gpu():
    rows = _fake_rows()
    rows[0]["optimizer_ms"], rows[0]["optimizer_compiled_ms"] = 1.5, None
    rows[0]["optimizer_spread"], rows[0]["optimizer_compiled_spread"] = 0.04, None
    table = L.comparison(rows)
    cpu = L.report_rows(table, _fake_memory(), rows, on_gpu=False)
    gpu = L.report_rows(table, _fake_memory(), rows, on_gpu=True)
    assert all(r["optimizer step ms"] is None and r["repeat spread %"] is None for r in cpu)
    assert gpu[0]["optimizer step ms"] == 1.5 and gpu[0]["bytes per parameter"] > 0
    assert gpu[0]["repeat spread %"] == pytest.approx(4.0)  # every timed row carries its spread
    assert set(L.RECIPE_REPORT_COLUMNS) <= set(gpu[0])
    assert "fp32 master" in L.format_rows(gpu, ["recipe", "final loss"])


def test_run_recipes_and_byte_gpt_on_tiny_sizes():
    corpus = L.text_corpus(8192)
    gpt = L.byte_gpt(corpus, dict(d_model=16, n_layers=1, n_heads=2, seq_len=16), 2, 3, "cpu",
                     warmup=1)
    x, y = gpt.batch(0)
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    rows = L.run_recipes(gpt, ("fp32 master", "bf16 + stochastic rounding"), "cpu", seeds=(0, 1))
    assert [(r["recipe"], r["seed"]) for r in rows] == [
        ("fp32 master", 0), ("fp32 master", 1), ("bf16 + stochastic rounding", 0)]
    assert all(r["status"] == "trained" and r["workload"] == "byte-level GPT" for r in rows)
    with pytest.raises(ValueError, match="seeds"):
        L.run_recipes(gpt, ("bf16",), "cpu", seeds=())


# --- figures ---------------------------------------------------------------------------------------

def test_figures_have_titles_and_axis_titles_with_units():
    rows = _fake_rows()
    for fig in (WP.recipe_losses(rows), WP.rounded_away(rows), WP.memory_by_category(_fake_memory())):
        assert fig.layout.title.text
        assert fig.layout.xaxis.title.text and "(" in fig.layout.yaxis.title.text
    assert {t.name for t in WP.memory_by_category(_fake_memory()).data} == {
        "weights", "gradients", "optimizer state", "activations"}
    for builder in (WP.recipe_losses, WP.rounded_away, WP.memory_by_category):
        with pytest.raises(ValueError):
            builder([])


def test_a_card_without_bf16_runs_fp16_autocast_and_says_what_it_skipped():
    w = _mlp_workload(4)
    rows = L.run_recipes(w, L.ALL_RECIPES, "cpu", seeds=(0, 1), amp_dtype=torch.float16,
                         bf16=False)
    status = {(r["recipe"], r["seed"]): r["status"] for r in rows}
    assert status[("fp32 master", 0)] == status[("fp32 master", 1)] == "trained"
    assert all(status[(n, 0)] == "not run: no native bf16 on this GPU" for n in L.TORCH_RECIPES[1:])
    assert "skipped bf16, bf16 + stochastic rounding, bf16 + Kahan: no native bf16" in L.skipped_line(rows)
    table = L.comparison(rows)
    memory = L.memory_table(rows)
    assert [m["recipe"] for m in memory] == ["fp32 master"]
    choice = L.choice_table(table, memory, cards=(("T4", 15, False),), sizes=(1e8, 1e9))
    assert choice == [{"model": "0.1 B parameters", "T4": "fp32 master (16.0 B/param)"},
                      {"model": "1 B parameters", "T4": "shard it (lesson 06)"}]


def test_show_rows_shows_an_html_table_in_the_lessons_number_style(monkeypatch, capsys):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    rows = [{"recipe": "bf16", "final loss": 1.23456, "peak MiB": None}]
    L.show_rows(rows, ["recipe", "final loss"])
    (bundle,) = shown
    assert "<th" in bundle["text/html"] and ">1.235</td>" in bundle["text/html"]
    assert "peak MiB" not in bundle["text/html"]
    assert bundle["text/plain"] == L.format_rows(rows, ["recipe", "final loss"])
    L.show_rows(rows)
    assert ">-</td>" in shown[-1]["text/html"]
    L.show_rows([])
    assert capsys.readouterr().out == "(no rows)\n" and len(shown) == 2


def test_cosine_lr_refuses_a_warmup_that_leaves_no_decay():
    """warmup >= steps used to be accepted, and the rate never decayed to floor * lr."""
    with pytest.raises(ValueError, match=r"warmup must be below steps \(10"):
        L.cosine_lr(1e-3, 10, warmup=20)
    at = L.cosine_lr(1e-3, 10, warmup=8)
    assert at(7) == pytest.approx(1e-3) and at(9) == pytest.approx(1e-3 * 0.1)


def _fp16_recipe(steps):
    torch.manual_seed(0)
    x, y = torch.randn(64, 16) * 100, torch.randint(0, 4, (64,))
    return optim.train_recipe(optim.get_recipe("fp32 master"),
                          lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                          lambda s: (x, y), F.cross_entropy, steps=steps, lr_at=lambda s: 1e-3,
                          device="cpu", amp_dtype=torch.float16)


def test_train_recipe_reports_skipped_steps_instead_of_rounded_away():
    row = _fp16_recipe(6)  # GradScaler backs off from 2**16 for the first five steps
    assert row["status"] == "trained"
    assert row["skipped_steps"] == [0, 1, 2, 3, 4]
    assert [s for s, _ in row["rounded_away"]] == [5]
    every = _fp16_recipe(3)
    assert every["status"] == "not trained: GradScaler skipped all 3 steps"
    assert every["rounded_away"] == [] and every["skipped_steps"] == [0, 1, 2]


def test_bf16_adamw_add_param_group_refuses_fp32_params():
    opt = optim.BF16AdamW([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="params must be bfloat16 tensors.*float32"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="params must be bfloat16"):
        opt.add_param_group({"params": (p for p in [nn.Parameter(torch.zeros(2))])})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))})
    assert len(opt.param_groups) == 2
