"""Lesson 09, your model: the doctor (``amp_lessons.doctor``) on three models, then on the
learner's own.

The three models: ResNet-50 (lesson 04's workload, at lesson 04's batch and settings, so the
doctor's speed rows can be checked against lesson 04's table measured in the same run), lesson
07's GPT on real text, and a small transformer that overflows fp16 (its residual stream grows
past 65,504, as in models pre-trained in bf16, whose range is fp32's). Each finding of the
doctor names the lesson that explains it; this module adds what the notebook needs around it:
the models, lesson 04's comparison, lesson 07's crossover width and the cheat sheet.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons.publish import claims
from amp_lessons import measure as bench
from amp_lessons import models
from amp_lessons.publish import report as _report
from amp_lessons.validate import check_int
from amp_lessons.data import synthetic_images
from amp_lessons.lessons import l04_resnet50 as l04
from amp_lessons.lessons import l07_fp8 as l07
from amp_lessons.lineage import traced  # explain names what made each row

LESSON = "09"
DECIDES = ()  # no article claim is decided here: the doctor's findings are measurements
REPO = Path(__file__).resolve().parents[2]
CHEAT_SHEET = REPO / "docs" / "cheat_sheet.md"
CHEAT_SHEET_URL = "https://github.com/amp-lessons/amp-lessons/blob/main/docs/cheat_sheet.md"
FP16_MAX = 65504.0
AGREEMENT = 0.05  # the doctor's ResNet-50 speed rows against lesson 04's: within 5%


# --- the practitioner's cheat sheet ---------------------------------------------------------------

def cheat_sheet() -> str:
    """The course's cheat sheet as markdown: ``docs/cheat_sheet.md`` with its citations filled
    from the notebooks' published tables (as the README shows it), else, where a citation finds
    nothing there (the learner's own runs of the lessons replaced the committed ones, say), the
    README's ``## Cheat sheet`` section, filled from the committed runs; where the package was
    installed without the repository (Colab, Kaggle), a line with its address instead."""
    if CHEAT_SHEET.is_file():
        text = CHEAT_SHEET.read_text(encoding="utf-8")
        results = None
        if _report.CITATION.search(text):
            from amp_lessons.publish.notebooks import course_notebooks
            results = _report.collect(course_notebooks(REPO / "notebooks"))
        try:
            return _report.cheat_sheet_body(text, results) + "\n"
        except ValueError:  # a citation the notebooks here cannot fill: the README's copy
            pass
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if "\n## Cheat sheet" in text:
        section = text.split("\n## Cheat sheet", 1)[1].split("\n## ", 1)[0]
        return "## Cheat sheet" + section.rstrip() + "\n"
    return f"The cheat sheet lives in the repository: [{CHEAT_SHEET_URL}]({CHEAT_SHEET_URL})."


# --- model 1: ResNet-50 at lesson 04's settings ------------------------------------------------------

def resnet_case(model: str = "resnet50", batch_size: int = 256, image_size: int = 224,
                device=None, seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor]]:
    """Lesson 04's ResNet (``bench.MODELS``) on ``device`` and one synthetic ImageNet-shaped
    batch ``(x, y)`` of lesson 04's size."""
    torch.manual_seed(seed)
    net = bench.MODELS[model](num_classes=1000).to(device)
    return net, synthetic_images(batch_size, image_size, 1000, device)


def lesson04_rows(model: str, batch_size: int, image_size: int, device, warmup: int,
                  steps: int, precisions: Sequence[str]) -> List[Dict[str, object]]:
    """Lesson 04's own rows for these precisions (its table's channels_last, standard-optimizer
    configurations, from ``l04.lesson_configs``), measured now with ``bench.run_configs``."""
    configs = [c for c in l04.lesson_configs(model, batch_size, image_size, compile_precision=None)
               if c.channels_last and c.impl == bench.STANDARD["impl"]
               and c.optimizer == bench.STANDARD["optimizer"] and c.model == model
               and c.precision in precisions]
    return bench.run_configs(configs, device, warmup=warmup, steps=steps, progress=False)


@traced
def agreement(report, rows: Sequence[Mapping]) -> List[Dict[str, object]]:
    """Per precision: the doctor's samples/s beside lesson 04's img/s from the same run, the
    difference in percent, the larger repeat spread of the two rows, and whether it is within
    ``AGREEMENT`` (None where the timing gate cannot decide: a CPU, too few steps, an idle GPU,
    repeats over 10% apart)."""
    out = []
    for r in rows:
        precision = r["config"]["precision"]
        mine = report.speed_row(precision)
        if mine is None:
            continue
        a, b = mine.get("samples_per_s"), r.get("img_per_s")
        diff = (a / b - 1) if a and b else None
        gate = claims.rows_timing_gate(r, dict(mine, label=f"the doctor's {precision} row"))
        decided = diff is not None and gate is None
        spreads = [v for v in (mine.get("spread"), r.get("spread")) if v is not None]
        out.append({"precision": precision, "doctor samples/s": a, "lesson 04 img/s": b,
                    "difference %": None if diff is None else 100 * diff,
                    "repeat spread %": 100 * max(spreads) if spreads else None,
                    "within 5%": (abs(diff) <= AGREEMENT) if decided else None,
                    "why not decided": "" if decided else (gate or "not timed").replace(
                        " the claim is about", "")})
    return out


AGREEMENT_COLUMNS = (("precision", "precision"), ("doctor samples/s", "doctor samples/s", ",.1f"),
                     ("lesson 04 img/s", "lesson 04 img/s", ",.1f"),
                     ("difference %", "difference %", "+.1f"),
                     ("repeat spread %", "repeat spread % (larger)", ".1f"),
                     ("within 5%", "within 5%"),
                     ("why not decided", "why not decided"))


# --- model 2: lesson 07's GPT on real text -------------------------------------------------------

def gpt_case(gpt: Mapping[str, int], batch_size: int, device=None, corpus_bytes: int = 200_000,
             seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor]]:
    """Lesson 07's GPT (``models.TinyTransformer`` over bytes, sized by ``gpt``) and one batch of
    the standard library's source with next-byte targets (lesson 07's text)."""
    check_int("batch_size", batch_size, 1)
    torch.manual_seed(seed)
    net = models.TinyTransformer(vocab_size=256, **gpt).to(device)
    text = l07.stdlib_corpus(max_bytes=corpus_bytes).train
    offsets = l07.batch_offsets(len(text), gpt["seq_len"], batch_size, 1, seed)[0]
    x, y = l07.text_batch(text, offsets, gpt["seq_len"])
    return net, (x.to(device), y.to(device))


# --- model 3: a transformer whose activations pass fp16's range -----------------------------------

def overflowing_transformer(d_model: int = 64, n_layers: int = 2, seq_len: int = 32,
                            batch_size: int = 8, margin: float = 4.0, device=None,
                            seed: int = 0) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor],
                                                    Dict[str, object]]:
    """A small GPT whose first block writes values past fp16's 65,504 into the residual stream.

    Built deterministically: seeded weights, then the first block's MLP output layer multiplied
    by the power of two that lifts its largest output on this batch to ``margin`` x 65,504. The
    LayerNorms that follow divide the scale out again, so in fp32 or bf16 (fp32's range) the
    model trains as before; in fp16 that layer's output is inf. This is what happens in models
    pre-trained in bf16: nothing kept the activations inside fp16's range. Returns the model,
    a batch of random byte ids with next-byte targets, and what was scaled (layer, factor).
    """
    check_int("d_model", d_model, 8)
    torch.manual_seed(seed)
    net = models.TinyTransformer(vocab_size=256, d_model=d_model, n_layers=n_layers,
                                 n_heads=max(1, d_model // 16), seq_len=seq_len).to(device)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    layer = net.blocks[0].mlp[2]
    found = {}
    handle = layer.register_forward_hook(lambda m, i, o: found.__setitem__("max", o.abs().max()))
    with torch.no_grad():
        net(x)
    handle.remove()
    factor = 2.0 ** math.ceil(math.log2(margin * FP16_MAX / float(found["max"])))
    with torch.no_grad():
        layer.weight.mul_(factor)
        layer.bias.mul_(factor)
    return net, (x, y), {"layer": "blocks.0.mlp.2", "factor": factor,
                         "largest_before": float(found["max"])}


# --- lesson 07's crossover width -------------------------------------------------------------------

def lesson07_crossover(notebook: Optional[Path] = None, recipe: str = "tensorwise"
                       ) -> Tuple[Optional[int], str]:
    """The smallest width from which FP8 (``recipe``) beat compiled bf16 in lesson 07's committed
    run (``l07.smallest_paying_width`` over its published speed rows) and where that run was
    made; ``(None, why)`` where the notebook or its rows are not there."""
    path = Path(notebook) if notebook is not None else REPO / "notebooks" / "07_fp8_training.ipynb"
    if not path.is_file():
        return None, f"lesson 07's notebook is not here ({path.name}): run lesson 07"
    found = [r for r in _report.collect([path], validate=False) if r["key"] == "lesson07.speed"]
    if not found:
        return None, "lesson 07's notebook holds no published speed sweep: run lesson 07"
    rows = [{"width": r["width"], "recipe": r["recipe"], "speedup": r["speed-up over bf16"]}
            for r in found[0]["rows"] if r.get("speed-up over bf16") is not None]
    width = l07.smallest_paying_width(rows, recipe) if rows else None
    run = found[0].get("run", {})
    where = (f"lesson 07's committed run on {run.get('device_name', 'an unknown GPU')}, "
             f"torch {run.get('torch', '?')}, {str(run.get('date', '?'))[:10]}")
    if width is None:
        return None, f"FP8 never paid in {where}"
    return width, where


# --- reading the three reports --------------------------------------------------------------------

@traced
def summary(reports: Mapping[str, object]) -> List[Dict[str, object]]:
    """One row per model: the verdict for this device, the alarms raised, the fp16 overflow
    site, the loss scale, the fastest precision (only where every timed row passed the timing
    gate) and the FP8 status."""
    out = []
    for name, r in reports.items():
        timed = [s for s in r.speed if s["status"] == "ok"]
        decided = timed and all(s["decided"] for s in timed)  # a ranking needs every row
        best = max(timed, key=lambda s: s["samples_per_s"])["precision"] if decided else \
            "not decided"
        out.append({"model": name, "verdict": r.verdict.get("text", ""),
                    "alarms": ", ".join(f"{a['class']} at {a['site']}" for a in r.alarms())
                    or "none",
                    "fp16 safe": r.advice["fp16_safe"],
                    "fp16 overflows in": ", ".join(o["layer"] for o in r.overflow[:2]) or "-",
                    "loss scale": "n/a" if r.scale_exponent is None else f"2^{r.scale_exponent}",
                    "fastest (decided)": best, "FP8": r.fp8["status"]})
    return out


# --- the doctor bench beside the tools a user reaches for first ---------------------------------

BENCH_COLUMNS = (("case", "case"), ("problem", "problem"), ("expected", "expected"),
                 ("doctor", "doctor"), ("alarms", "the doctor's alarms (site)"),
                 ("hooks_found", "abs-min/max hooks"), ("hooks", "hooks report"),
                 ("anomaly_found", "detect_anomaly"), ("anomaly", "detect_anomaly reports"),
                 ("seconds", "doctor s", ".2f"))


def bench_summary(rows: Sequence[Mapping]) -> List[Dict[str, object]]:
    """Per tool: how many problem cases it found at their site, missed or flagged elsewhere,
    and how many healthy models it raised an alarm on (``doctor.bench.run`` rows)."""
    problems = [r for r in rows if r["expected"] != "no alarm"]
    healthy = [r for r in rows if r["expected"] == "no alarm"]
    out = []
    for tool, key, hit in (("the doctor", "doctor", "diagnosed"),
                           ("forward hooks, abs-min/abs-max", "hooks_found", "found"),
                           ("torch.autograd.detect_anomaly", "anomaly_found", "found")):
        out.append({"tool": tool, "problems found at their site":
                    sum(r.get(key) == hit for r in problems),
                    "problems": len(problems),
                    "flagged elsewhere": sum(r.get(key) == "flagged elsewhere" for r in problems),
                    "false alarms (healthy models)": sum(r.get(key) == "false alarm"
                                                         for r in healthy),
                    "healthy models": len(healthy)})
    return out


# --- the doctor changes nothing ---------------------------------------------------------------------

def fingerprint(model: nn.Module) -> Dict[str, object]:
    """What must be the same after the doctor: every parameter and buffer (copied), the training
    mode of every module and ``requires_grad`` of every parameter."""
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "training": [m.training for m in model.modules()],
            "requires_grad": [p.requires_grad for p in model.parameters()],
            "grads": [p.grad is None for p in model.parameters()]}


def unchanged(model: nn.Module, before: Mapping[str, object]) -> bool:
    """True when ``model`` matches the ``fingerprint`` taken before, bit for bit."""
    now = fingerprint(model)
    same_state = now["state"].keys() == before["state"].keys() and all(
        torch.equal(now["state"][k], before["state"][k]) for k in now["state"])
    return same_state and all(now[k] == before[k] for k in ("training", "requires_grad", "grads"))
