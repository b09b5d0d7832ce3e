"""What the doctor's held-out test files share: the quick settings, seeded inputs, and the report
a healthy model must get."""
import torch

import amp_lessons as al

QUICK = dict(precisions=(), trial_steps=1, compile=False)


def seeded(s=0):
    """Seed torch's global generator with ``s`` and return a generator seeded the same way."""
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


def classes(n=8, d=16, k=4, s=0):
    """A seeded classification batch: ``n`` rows of ``d`` features, class ids below ``k``."""
    g = seeded(s)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


def healthy_report(model, **kwargs):
    """The doctor's report on ``model`` (QUICK settings, ``kwargs`` over them), checked as a
    healthy model's: no alarm, fp16 safe, the CPU verdict, and no "fp16 is unsafe" for a GPU."""
    r = al.doctor(model, **{**QUICK, **kwargs})
    assert not r.alarms(), [(a["class"], a["site"], a["finding"]) for a in r.alarms()]
    assert r.advice["fp16_safe"] is True, r.advice["lines"]
    assert r.verdict["text"].startswith("stay in fp32: CPU")
    assert "fp16 is unsafe" not in r.verdict["on_gpu"]
    return r
