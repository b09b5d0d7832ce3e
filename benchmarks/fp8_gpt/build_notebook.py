"""Write notebooks/10_fp8_end_to_end.ipynb (lesson 10) from the cells below, unexecuted.

    python benchmarks/fp8_gpt/build_notebook.py

Then execute it on an FP8 GPU: ``python -m amp_lessons run-notebooks --profile full
notebooks/10_fp8_end_to_end.ipynb``.
"""
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from notebook_contract import new_notebook  # noqa: E402

NAME = "10_fp8_end_to_end.ipynb"
TITLE = "Lesson 10: FP8 end to end: where it pays on a whole GPT, which recipe, and a prediction"
INTRO = (
    "Lesson 07 measured torchao's FP8 training at about 1.45x compiled bf16 on a stack of "
    "4,096-wide MLP blocks. That stack is a microbenchmark: nearly all of its step is large GEMMs. "
    "A whole GPT also spends its step in attention (which stays in bf16), in norms, activations, "
    "the loss and the optimizer, and it pays FP8's casts on every converted layer. This lesson "
    "trains GPTs of several sizes in bf16 and in each of torchao's FP8 recipes, measures where the "
    "time goes, predicts each speed-up from the model's shapes before looking at the FP8 run, and "
    "compares the losses over several seeds.")
LEARN = [
    "how much of a GPT's step FP8 can touch (its Linear GEMMs), and what it cannot (attention, the "
    "LM head, norms, the optimizer, the host)",
    "torchao's three recipes, `tensorwise`, `rowwise` and `rowwise_with_gw_hp`, on whole GPTs: "
    "tokens/s, the step split by kernel kind from the profiler, peak memory, compile time",
    "to predict FP8's end-to-end speed-up from a model's `nn.Linear` shapes, a measured GEMM gain "
    "per shape and the measured cost of the casts, and to check the prediction",
    "to compare FP8's loss with bf16's against the spread of bf16's own seeds",
    "what FSDP2's FP8 all-gather would save at 8 GPUs, as a model from bytes and bandwidth",
]
HARDWARE = ("an FP8 GPU (compute capability 8.9+: H100/H200, L4, RTX 4090) and torchao "
            "(`make torchao`) for the FP8 rows; the `full` profile's largest GPT (2.0B parameters) "
            "needs about 40 GiB. Anywhere else a tiny GPT runs in bf16 and every FP8 row says "
            "\"not decided here\".")

PARAMETERS = '''\
# Sizes come from the profile and from what this machine can do: GPTs of 163M to 2.0B parameters
# in the `full` profile on a GPU where FP8 runs, one tiny GPT (seconds on a CPU) everywhere else.
import torch
from amp_lessons.lessons import l10_fp8_gpt as lesson  # this lesson's plan, tables and sentences
SUPPORT = lesson.fp8_support(env.device)               # FP8 tensor cores and torchao, or why not
BIG = not env.quick and SUPPORT.available
PLAN = lesson.sweep_plan(BIG)                          # (GPT size, recipes) pairs
BATCH = 8 if BIG else 2                                # sequences per step (1,024 tokens each on the GPU)
TIMED_STEPS, WARMUP, PROFILED = (15, 3, 1) if BIG else (2, 1, 1)
COMPILE = env.is_cuda                                  # each block compiled on its own
PARITY_SHAPE = lesson.PARITY_FULL if BIG else lesson.PARITY_QUICK
PARITY = dict(seeds=(0, 1, 2), steps=80 if BIG else 5, batch_size=BATCH,
              lr=6e-4 if BIG else 2e-3, warmup_steps=16 if BIG else 2, eval_batches=8 if BIG else 1)
MIN_STEPS = 50                                         # fewer steps than this decide no loss gap
CORPUS_BYTES = None if BIG else 200_000                # None: the whole standard library
WORLD, NVLINK_GBPS = 8, lesson.NVLINK_H100_H200_GBPS   # the all-gather model (section 7)
print(f"{len(PLAN)} GPT size(s), batch {BATCH}, {TIMED_STEPS} timed steps after {WARMUP} warm-up")'''

CELLS = [
    ("md", """## 1. What FP8 can touch in a GPT

torchao's `convert_to_float8_training` swaps `nn.Linear` layers for `Float8Linear`: their three
GEMMs per step (forward, gradient of the input, gradient of the weight) run on FP8 tensor cores,
at up to twice bf16's rate. Nothing else changes. The GPTs here are the course's
`models.TinyTransformer` at GPT sizes: GPT-2's vocabulary (50,304 with padding), sequences of 1,024
tokens, pre-LayerNorm blocks, an untied LM head. The head stays in bf16 (its output feeds the loss
directly), so only the blocks' four Linears per layer convert.

From the shapes alone, before anything runs, here is how each GPT's arithmetic divides between the
blocks' Linears, the LM head and attention's two batched products:"""),
    ("code", """lesson.show(lesson.flops_rows(PLAN, BATCH), title="Arithmetic per training step, from the shapes",
            note="made by lesson.flops_rows: 6 FLOPs per multiply-add and token for each Linear "
                 "(forward and backward); attention 4 b T^2 d per layer forward, times 3 with "
                 "backward, halved by the causal mask.")"""),
    ("md", """FLOPs are not time: the LM head and attention run at different efficiencies, and the
memory-bound kernels (norms, GELU, the loss, AdamW) take time with almost no FLOPs. But the
smaller the GPT, the larger the share FP8 cannot touch: the LM head alone is 29% of the smallest
GPT's arithmetic and 11% of the largest's (the table above; it depends on the shapes only)."""),
    ("md", """## 2. Calibration: what FP8 gains per GEMM shape, and what its casts cost, on this GPU

Two measurements feed the prediction in section 4, neither of them a GPT:

- every GEMM shape the GPTs use, timed in bf16 (`torch.mm`) and in FP8 (`torch._scaled_mm` with
  the recipe's scales and accumulation: `rowwise` runs its backward GEMMs on the per-tensor
  cuBLAS kernel and rescales the output, as torchao does), with the GPU kept busy so that the
  host's launch time is not what is timed;
- three cast kernels, compiled: an amax and a scaled cast with one scale, the same with a scale
  per row, and a transposed FP8 copy, each at two sizes (a fixed cost and a cost per element).

The gain is the three GEMMs' bf16 time over their FP8 time."""),
    ("code", """print(SUPPORT.line())
calibrations = lesson.calibrate(PLAN, BATCH, SUPPORT, env.device)
if calibrations:
    lesson.show(lesson.gemm_rows(calibrations, PLAN, BATCH),
                title="The three GEMMs of each Linear shape (ms per step, one layer)",
                note="made by measure.fp8_predict.measure_calibration: device time, CUDA events "
                     "around 10 calls queued behind a spinning kernel, median of 3.")
    lesson.show(lesson.cast_rows(next(iter(calibrations.values()))), title="The cast kernels",
                note="made by measure.fp8_predict.measure_casts: torch.compile'd, timed at 1M "
                     "and 33.5M elements; 'GB/s implied' counts 5 bytes per element for a "
                     "cast of bf16 and 2 for an FP8 copy.")
else:
    print("Not decided here: needs an FP8 GPU (capability 8.9+) and torchao.")"""),
    ("md", """Read the gain column by width. Timed on the device alone, even the GPTs' narrowest GEMMs
gain from FP8, least the square ones (the attention output projection, 768 or 1,024 wide), and
from 2,048 up the gain approaches 2x (`rowwise_with_gw_hp` keeps the grad-weight GEMM in bf16 and
gains less on every shape). The GEMMs are not what holds a small GPT back: the casts are
memory-bound, their cost grows with the tensors' sizes, and a small GPT's GEMMs are a small part
of its step (sections 4 and 6)."""),
    ("md", """## 3. Whole GPTs: bf16 against each FP8 recipe

Each GPT trains on random tokens with bf16 autocast and fused AdamW, every block compiled on its
own (the blocks are identical: one compilation serves them all), in bf16 and in each recipe of
the plan, the LM head in bf16. Peak memory is reset before each model is built. The first step
compiles and is timed on its own; then `WARMUP` steps, `TIMED_STEPS` steps timed with CUDA events
(the median gives tokens/s), and `PROFILED` more under `torch.profiler`.

Each recipe compiles once per GPT size (5 to 20 s), so the `full` plan keeps its run to a few
minutes of GPU time: every recipe on the smallest GPT, bf16 / tensorwise / rowwise on the largest,
bf16 / tensorwise in between. `PLAN = lesson.sweep_plan(True, every_recipe=True)` runs all four
recipes on every size."""),
    ("code", """rows = lesson.run_sweep(PLAN, BATCH, TIMED_STEPS, WARMUP, PROFILED, SUPPORT, env.device,
                       compile=COMPILE, progress=lambda r: print(lesson.progress_line(r)))
lesson.show(lesson.speed_rows(rows), title="Compiled bf16 against torchao float8, whole GPTs",
            note="made by measure.gpt_fp8.gpt_speed_sweep (measure_gpt_step per row). speed-up: "
                 "bf16's median step over the recipe's, same GPT, same run; min-max %: the fastest "
                 "to the slowest timed step; repeat spread: the timed steps split in 3 blocks, "
                 "their medians' range; compile s: the first step minus a timed one.")"""),
    ("md", """`speed-up` below 1 means FP8 made training slower. Peak memory falls with FP8 because the
compiled step keeps FP8 copies of activations for the backward pass; weights, gradients and AdamW
state stay fp32 in every recipe (16 bytes per parameter). `rowwise` scales every row of every tensor
and casts each tensor twice (along each axis its two GEMMs need); `rowwise_with_gw_hp` keeps the
weight-gradient GEMM in bf16, for accuracy: it gives up that GEMM's gain but also two of rowwise's
casts."""),
    ("md", """## 4. Where the time goes

The profiler's kernels, added up by kind: `gemm` (cuBLAS and CUTLASS matrix products, FP8 or
not), `attention` (cuDNN's or flash attention's kernels), `fp8 cast` (compiled kernels that take an
amax or saturate into FP8's range: torchao's casts, with whatever inductor fused into them),
`optimizer` (fused AdamW), `other` (norms, GELU, the loss, copies), and `idle`: the step minus the
time the GPU was busy, the GPU waiting for the host."""),
    ("code", """lesson.show(lesson.split_rows(rows), title="The step by kernel kind (ms per step)",
            note="made by measure.gpt_fp8.kernel_split (torch.profiler, device activity) and "
                 "measure_gpt_step (idle = median step - busy time).")"""),
    ("code", """# The three longest kernels of each kind in the largest GPT's bf16 and tensorwise steps (what the
# kinds above are made of; ms per step).
largest = max(r["params"] for r in rows)
for r in rows:
    if r["params"] == largest and r["recipe"] in ("bf16", "tensorwise") and r.get("split"):
        print(f"{r['model']}, {r['recipe']}:")
        for kind, top in r["split"]["top"].items():
            for ms, name in top:
                print(f"   {kind}: {ms:.3f} ms  {name[:80]}")""", ["requires-gpu"]),
    ("md", """## 5. The speed-up predicted from the shapes

`measure.fp8_predict.predict_fp8_speedup(model, calibration, tokens=..., bf16_step_ms=...)` reads
the model's `nn.Linear` shapes and the rows each sees per step, looks up each converted layer's
three GEMMs in the calibration (bf16 and FP8 time), adds the casts torchao's recipe makes for that
layer (counted from its `Float8Linear`, costed with the calibrated cast kernels), and subtracts:

    FP8 step = bf16 step - (bf16 GEMMs - FP8 GEMMs) + casts

It uses the measured bf16 step and nothing from the FP8 run. Beside each prediction: the two terms
as the profiler measured them (GEMM time saved, and the time FP8 added outside GEMMs)."""),
    ("code", """predictions = lesson.prediction_rows(rows, calibrations, PLAN, BATCH)
lesson.show(predictions, title="Predicted against measured speed-up",
            note="made by lesson.prediction_rows with measure.fp8_predict.predict_fp8_speedup; "
                 "GEMM share: the converted layers' bf16 GEMMs (calibration) over the bf16 step; "
                 "error %: (predicted - measured) / measured.")"""),
    ("md", """Where the prediction misses, the two pairs of columns say which term missed. A GEMM saving
measured larger than predicted means bf16's GEMMs ran slower inside the model than alone (the bf16
model's Linears carry a bias in their GEMM's epilogue; FP8 adds it in a fused pointwise kernel); an
added time smaller than predicted means inductor fused the casts into their neighbours (the amax
into the GELU or the LayerNorm) better than the calibration's stand-alone kernels. The predictor
counts device time only: where FP8's step waits on the host (the `idle` column of section 4; more
kernels to launch per layer), it predicts too high. The predictor is what the course's doctor uses
on your own model."""),
    ("md", """## 6. What stands in the way

Measured, per FP8 row: the bf16 step's GEMM, attention and idle shares, FP8's cast kernels and all
the time it added outside GEMMs as shares of its own step, and two ceilings. `if GEMMs were 2x` is
Amdahl's bound: every GEMM (the LM head's too) twice as fast, nothing added. `without added time`
is FP8's measured step with the added non-GEMM time taken away: what fusing every cast into its
neighbour (the norm before it, the GELU) would reach."""),
    ("code", """lesson.show(lesson.obstacle_rows(rows), title="The limits, measured",
            note="made by lesson.obstacle_rows from measure.gpt_fp8.kernel_split's splits.")"""),
    ("md", """What would remove them, as published elsewhere (claims, not measured here):

- **FP8 attention.** FlashAttention-3 (Shah et al., 2024, arXiv:2407.08608) reports attention at up
  to 740 TFLOP/s in FP16 and close to 1.2 PFLOP/s in FP8 on an H100: attention's share above could
  shrink by up to about a third of itself. PyTorch's `scaled_dot_product_attention` runs it in bf16.
- **Casts fused into their neighbours.** torchao relies on `torch.compile` to fuse each amax and
  cast with the op before it; the `fp8 cast` kernels above are what remained as separate passes.
- **More GPUs.** torchao's documentation reports up to 1.25x at 8 GPUs for an 8B-parameter model
  and up to 1.5x at 512 GPUs for 405B parameters; for Llama3-8B on 8 H100s, +25% with tensorwise
  and an FP8 all-gather against +10% with rowwise. Larger models have wider GEMMs and a smaller
  LM-head share; section 8 prices the all-gather."""),
    ("md", """## 7. Loss parity: the same GPT on real text, three seeds per recipe

Speed is half the question. The smallest GPT's blocks (768 wide, 12 layers; bytes as tokens, so
a 256-token head) train on the Python standard library's own source, in bf16 and in each recipe,
with seeds 0, 1 and 2: one seed gives every recipe the same initial weights and the same batches,
so runs with one seed differ only in their arithmetic. AdamW with a linear warm-up then cosine
decay, gradients clipped at 1. Each recipe compiles once; each seed loads fresh initial weights."""),
    ("code", """corpus = lesson.stdlib_corpus(CORPUS_BYTES)
print(corpus.describe())
runs = lesson.parity_runs(corpus, PARITY_SHAPE, lesson.GPT_RECIPES, support=SUPPORT,
                          device=env.device, compile=COMPILE, **PARITY)
parity = lesson.parity_summary(runs, MIN_STEPS)
lesson.show(parity["rows"], title=f"Loss after {PARITY['steps']} steps, mean over seeds",
            note="made by measure.gpt_fp8.parity_runs and lesson.parity_summary. final loss: mean "
                 "training loss of the last 10% of steps; held-out loss: the same fixed held-out "
                 "batches for every run. diff: the recipe's held-out loss minus bf16's with the "
                 "same seed; within: |mean diff| <= bf16's seed spread (largest minus smallest "
                 "held-out loss over its seeds).")
if not parity["decided"]:
    print(f"Not decided here: {parity['reason']}.")"""),
    ("md", """The spread of bf16's seeds says how much losses differ for reasons that have
nothing to do with FP8. A difference inside it is not FP8's doing; a spread wider than the
differences in question decides nothing, and the table says so. These runs are short (the GPU time
of one lesson): a gap that opens late in a long run cannot show here."""),
    ("md", """## 8. Beyond one GPU, on paper

With FSDP2 each GPU holds a shard of every weight and all-gathers the full weight before the
forward and again before the backward. torchao can all-gather the converted weights in FP8
(`enable_fsdp_float8_all_gather`): half the bytes of bf16. This is **a model, not a measurement**:
bytes from the GPTs' converted weights, bandwidth from NVLink 4's datasheet figure (450 GB/s per
GPU and direction; NCCL reaches less, so the saving is an upper bound), and it only shortens the
step where the gathers are not already hidden behind compute. No machine with several GPUs ran
here."""),
    ("code", """gather = lesson.all_gather_rows(PLAN, rows, WORLD, NVLINK_GBPS)
lesson.show(gather, title=f"FSDP2 all-gather per step at {WORLD} GPUs: bf16 against FP8 (a model)",
            note="made by measure.fp8_predict.fp8_all_gather_saving: (GPUs - 1) / GPUs of each "
                 "converted weight, twice per step, at 2 or 1 byte per element, over the "
                 "bandwidth; '% of the FP8 step': against the one-GPU tensorwise step measured above.")"""),
    ("md", """## 9. What this run measured"""),
    ("code", """for line in lesson.findings(SUPPORT, rows, predictions, parity):
    print(line)"""),
    ("md", """**Takeaway:** FP8 pays on a whole GPT only where the converted GEMMs are wide enough and
large enough a share of the step to outrun its casts; the model's shapes and two calibrations
predict where that is before you train."""),
    ("md", """## Questions

Questions a practitioner should be able to answer after this lesson. Think first, then click a
question to see the answer.

<details><summary><b>Why does lesson 07's 1.45x not carry over to a 400M-parameter GPT?</b></summary>

Its MLP stack was almost all wide GEMMs. In a GPT of width 1,024 the converted GEMMs are well
under half of the bf16 step (the LM head, attention, norms, the loss, AdamW and host time are the
rest, and FP8 touches none of them), so even a 1.5x faster GEMM saves little, while the casts of
every converted layer add memory-bound time of the same order (sections 4 and 6).

</details>

<details><summary><b>Which recipe is fastest, and which would you train with?</b></summary>

`tensorwise` is usually the fastest (one scale, the cuBLAS kernel); `rowwise` casts every tensor
twice and rescales two GEMM outputs; `rowwise_with_gw_hp` keeps a third of the GEMMs in bf16. The
rowwise recipes are the more accurate ones; choose by the loss comparison of section 7 on your
model, at a length where bf16's seed spread is small enough to tell.

</details>

<details><summary><b>How do you predict FP8's speed-up for your own model before converting it?</b></summary>

Measure the bf16 step, list the `nn.Linear` shapes with the rows each sees, time those GEMM shapes
in bf16 and FP8 and the cast kernels on your GPU, then FP8 step = bf16 step - GEMM time saved +
cast time (`measure.fp8_predict.predict_fp8_speedup`, which the doctor runs).

</details>

<details><summary><b>Why compare with bf16's seed spread and not with one bf16 run?</b></summary>

Two bf16 runs with different seeds already end at different losses; a difference FP8 shows inside
that spread cannot be told from a change of seed.

</details>

<details><summary><b>What does FP8 do to peak memory?</b></summary>

It lowers it somewhat: the compiled step keeps FP8 copies of activations for the backward pass.
Weights, gradients and AdamW state stay fp32 (16 bytes per parameter) in every recipe.

</details>

<details><summary><b>When does the FP8 all-gather pay?</b></summary>

When FSDP2's gathers are not hidden behind compute: many GPUs, slow links, small per-GPU batches.
The saving is half the gathered bytes of the converted weights over the link's bandwidth
(section 8, a model).

</details>

### Further research

1. Turn the LM head into FP8 too (`measure.gpt_fp8.convert_gpt` with your own
   `module_filter_fn`) on the smallest GPT: how much of the gap to bf16 closes, and what happens
   to the loss in section 7?
2. Double the batch (`BATCH = 16`) or the sequence (a `GPTShape(..., seq_len=2048)`): which of the
   prediction's terms grows, and does the smallest paying GPT move? Check the predictor first,
   then measure.
3. Run `torch.compile` with `mode="max-autotune"` on the blocks of the largest GPT: does inductor
   fuse more of the casts (the `fp8 cast` column), and by how much does the measured speed-up
   approach the `without added time` ceiling?"""),
    ("md", "## Checks"),
    ("code", """# The plan ran: one row per GPT and recipe in order; bf16 measured everywhere; FP8 measured where
# it runs (an out-of-memory row is a row), "not measured" with the reason everywhere else.
assert [(r["model"], r["recipe"]) for r in rows] == [(s.label, rc) for s, rcs in PLAN for rc in rcs]
assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows if r["recipe"] == "bf16")
flops = lesson.flops_rows(PLAN, BATCH)
assert all(abs(f["blocks' Linears %"] + f["LM head %"] + f["attention %"] - 100) < 1e-6 for f in flops)
if SUPPORT.available:
    assert all(r["status"] == "measured" or r["status"] == "not measured: out of memory" for r in rows)
    measured = [r for r in rows if r["status"] == "measured"]
    assert all(r["speedup"] > 0 and r["peak_gib"] > 0 and r["compile_s"] >= 0 for r in measured)
    assert all(r["split"]["busy_ms"] > 0 and r["split"]["gemm"] > 0 for r in measured if COMPILE)
else:
    assert all(r["status"] == f"not measured: {SUPPORT.reason}" for r in rows if r["recipe"] != "bf16")"""),
    ("code", """# The prediction: made for every FP8 row measured here, from a calibration of this GPU; "not
# decided here" where FP8 does not run.
assert len(predictions) == sum(r["recipe"] != "bf16" for r in rows)
if SUPPORT.available:
    assert set(calibrations) == {rc for _, rcs in PLAN for rc in rcs} - {"bf16"}
    assert all(p["predicted"] > 0 and p["GEMM share"] > 0 for p in predictions if p["measured"])
else:
    assert calibrations == {}
    assert all(p["predicted"] is None and p["status"].startswith("not decided") for p in predictions)"""),
    ("code", """# Loss parity: every bf16 seed trained to a finite loss below where it started; FP8 runs trained
# where FP8 runs; the comparison says why whenever it is not decided.
bf16_runs = [r for r in runs if r["recipe"] == "bf16"]
assert len(bf16_runs) == len(PARITY["seeds"]) and all(r["status"] == "trained" for r in bf16_runs)
assert all(r["finite"] and r["final_loss"] < r["losses"][0] for r in runs if r["status"] == "trained")
assert len([r for r in runs if r["status"] == "trained"]) == (len(runs) if SUPPORT.available else len(bf16_runs))
assert parity["decided"] == (parity["reason"] == "")
if not parity["decided"]:
    assert all(r["status"].startswith(("measured, not compared: ", "not run: "))
               for r in parity["rows"] if r["recipe"] != "bf16")"""),
    ("code", """# The all-gather model: FP8 moves half of bf16's bytes, and the saving is that half over the bandwidth.
assert all(abs(2 * g["gathered GB/step (FP8)"] - g["gathered GB/step (bf16)"]) < 1e-9 for g in gather)
assert all(abs(g["saved ms"] - g["FP8 ms"]) < 1e-9 and g["kind"] == "model" for g in gather)
assert lesson.findings(SUPPORT, rows, predictions, parity)[0] == SUPPORT.line()"""),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(NAME, TITLE, LEARN, HARDWARE, PARAMETERS, intro=INTRO)
    for cell in CELLS:
        kind, source = cell[0], cell[1]
        tags = cell[2] if len(cell) > 2 else None
        meta = {"tags": tags} if tags else {}
        nb.cells.append(new_markdown_cell(source) if kind == "md" else
                        new_code_cell(source, metadata=meta))
    return nb


if __name__ == "__main__":
    path = ROOT / "notebooks" / NAME
    nbformat.write(build(), path)
    print(f"wrote {path}")
