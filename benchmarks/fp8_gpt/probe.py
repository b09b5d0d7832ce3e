"""First GPU probe for lesson 10 (issue 43): the engine's calibration, one GPT size in every
recipe with its kernel split, and a few parity steps, timed stage by stage so the notebook's full
run can be sized to the device time available. Run from the repository root on the GPU machine:

    python3 benchmarks/fp8_gpt/probe.py --out $OUT/probe.json

(the engine files must be importable as amp_lessons.measure.gpt_fp8 / fp8_predict).
"""
import argparse
import json
import sys
import time

import torch

from amp_lessons.data import stdlib_corpus
from amp_lessons.measure import fp8_predict as fp
from amp_lessons.measure import gpt_fp8 as g
from amp_lessons.measure.float8 import fp8_support

SIZES = {"125m": g.GPTShape(768, 12, 12), "350m": g.GPTShape(1024, 24, 16),
         "1.3b": g.GPTShape(2048, 24, 16), "4096w": g.GPTShape(4096, 8, 32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="125m")
    ap.add_argument("--recipes", default=",".join(g.GPT_RECIPES))
    ap.add_argument("--later-recipes", default="bf16,tensorwise",
                    help="recipes for every size after the first")
    ap.add_argument("--parity-steps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    stages = {}
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
           "support": fp8_support(dev).line(), "stages": stages}
    print(out["support"], flush=True)

    tokens = 8 * 1024
    t = time.perf_counter()
    casts = fp.measure_casts(dev)
    stages["casts_s"] = time.perf_counter() - t
    out["casts"] = casts
    print("casts", casts, stages, flush=True)
    cals = {}
    t = time.perf_counter()
    with torch.device("meta"):
        models = {k: s.build() for k, s in SIZES.items()}
    for recipe in fp.PREDICT_RECIPES:
        shapes = [sh for m in models.values()
                  for sh in fp.linear_shapes(m, tokens=tokens, module_filter_fn=fp.gpt_body_filter)]
        cals[recipe] = fp.measure_calibration(shapes, recipe, dev, casts=casts)
    stages["gemms_s"] = time.perf_counter() - t
    out["gemms"] = {r: {"x".join(map(str, k[:3])) + ":" + k[3]: v for k, v in c.gemms.items()}
                    for r, c in cals.items()}
    print("gemm calibration", stages, flush=True)
    for r, c in cals.items():
        for k, v in list(c.gemms.items())[:12]:
            print(r, k, f"bf16 {v[0]:.4f} fp8 {v[1]:.4f} gain {v[0] / v[1]:.2f}", flush=True)

    rows = []

    def progress(row):
        keep = {k: row.get(k) for k in ("model", "recipe", "step_ms", "tokens_per_s", "spread",
                                        "spread_pct", "peak_gib", "compile_s", "first_step_s",
                                        "status")}
        print(json.dumps(keep), f"t={time.perf_counter() - t0:.0f}s", flush=True)
        if row.get("split"):
            sp = row["split"]
            print("   split", {k: round(sp[k], 3) for k in g.KERNEL_KINDS + ("busy_ms",)}, flush=True)
            for kind, top in sp["top"].items():
                for ms, name in top:
                    print(f"     {kind:10s} {ms:8.3f} {name}", flush=True)

    for i, key in enumerate(args.sizes.split(",")):
        t = time.perf_counter()
        recipes = args.recipes if i == 0 else args.later_recipes
        rows += g.gpt_speed_sweep([SIZES[key]], recipes.split(","), device=dev,
                                  progress=progress)
        stages[f"sweep_{key}_s"] = time.perf_counter() - t
        print(stages, flush=True)
    for r in rows:
        if r["recipe"] == "bf16" or not r.get("step_ms"):
            continue
        base = next(b for b in rows if b["model"] == r["model"] and b["recipe"] == "bf16")
        key = next(k for k, s in SIZES.items() if s.label == r["model"])
        pred = fp.predict_fp8_speedup(models[key], cals[r["recipe"]], tokens=tokens,
                                      bf16_step_ms=base["step_ms"], recipe=r["recipe"],
                                      module_filter_fn=fp.gpt_body_filter)
        gemm_meas = base["split"]["gemm"] - r["split"]["gemm"]
        rest = lambda s: s["busy_ms"] - s["gemm"]  # noqa: E731
        print(f"{r['model']} {r['recipe']}: measured {r['speedup']:.3f} predicted "
              f"{pred.speedup:.3f}; gemm saved pred {pred.gemm_saved_ms:.2f} meas {gemm_meas:.2f}; "
              f"cast pred {pred.cast_ms:.2f} meas(rest diff) {rest(r['split']) - rest(base['split']):.2f} "
              f"cast kernels {r['split']['fp8 cast']:.2f}; gemm share {pred.gemm_share:.2f}",
              flush=True)
    out["rows"] = rows

    if args.parity_steps:
        t = time.perf_counter()
        corpus = stdlib_corpus()
        shape = g.GPTShape(768, 12, 12, vocab_size=256)
        runs = g.parity_runs(corpus, shape, ("bf16", "tensorwise"), seeds=(0, 1),
                             steps=args.parity_steps, warmup_steps=5, device=dev)
        stages["parity_s"] = time.perf_counter() - t
        for r in runs:
            print(r["label"], r.get("final_loss"), r.get("val_loss"), r.get("seconds"), flush=True)
        out["parity"] = [{k: v for k, v in r.items() if k != "losses"} for r in runs]
    stages["total_s"] = time.perf_counter() - t0
    print(stages, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
