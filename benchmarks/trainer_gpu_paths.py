"""`python benchmarks/trainer_gpu_paths.py` (writes $OUT/gpu_paths.json; runs on a CPU too, without the capture part).

GPU-only paths of the trainer's lazy records, checked on a real GPU (issue 22):
1. the fp16 loss scale each record reads (ScaleLog replaying torch._amp_update_scale_ on CUDA
   copies) equals GradScaler's own scale before each step of a hand loop (bitwise), through
   growth and backoff;
2. the gradient norm read lazily from _foreach_norm's one-tensor CUDA output equals
   clip_grad_norm_'s total norm of the same gradients (bitwise);
3. step times from pooled, chained CUDA events: every time_s finite and > 0, their sum within 5%
   of the synchronised wall span, the pool bounded when records are read every 100 steps; the
   same through a captured step's replays."""
import json, math, os, sys, time
import torch
import torch.nn.functional as F
from torch import nn
from amp_lessons.train import trainer as T
from amp_lessons.train.scaler import ScalerSettings

if "OUT" not in os.environ:
    sys.exit("set OUT to the folder for gpu_paths.json")


def finish():
    """Print the findings, write them to $OUT/gpu_paths.json and stop."""
    print(json.dumps(out, indent=1, default=str))
    with open(os.path.join(os.environ["OUT"], "gpu_paths.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    sys.exit(0)


dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
out = {}


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(dev)


g = torch.Generator(device="cpu").manual_seed(0)
data = [(torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(120)]
bad = {20, 21, 47, 90}  # steps whose input is inf: the scale backs off there
data = [((x * float("inf")) if i in bad else x, y) for i, (x, y) in enumerate(data)]
data = [(x.to(dev), y.to(dev)) for x, y in data]
settings = ScalerSettings(init_scale=2.0 ** 10, growth_interval=7)

# 1. scale: trainer (lazy) against a hand loop reading GradScaler's scale before each step
model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
tr = T.Trainer(model, opt, T.TrainConfig(precision="fp16", scaler=settings, progress=False,
                                         track_memory=False))
records = [tr.train_step([b]) for b in data]
lazy = [r.scale for r in records]
hand_model = mlp(); hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler(dev.type, init_scale=settings.init_scale, growth_factor=settings.growth_factor,
                              backoff_factor=settings.backoff_factor, growth_interval=settings.growth_interval)
hand = []
hand_norms = []
for x, y in data:
    hand.append(scaler.get_scale())
    with torch.autocast(dev.type, dtype=torch.float16):
        loss = F.cross_entropy(hand_model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(hand_opt)
    hand_norms.append(torch.nn.utils.clip_grad_norm_(hand_model.parameters(), float("inf")).item())
    scaler.step(hand_opt); scaler.update(); hand_opt.zero_grad(set_to_none=True)
out["scale_equal"] = lazy == hand
out["scale_values"] = sorted(set(hand))
out["skipped"] = [i for i, r in enumerate(records) if r.skipped]
norms = [r.grad_norm for r in records]
ok = [i for i in range(len(data)) if i not in bad]
out["norm_equal_on_finite_steps"] = all(norms[i] == hand_norms[i] for i in ok)
out["norm_max_rel_diff"] = max(abs(norms[i] - hand_norms[i]) / max(hand_norms[i], 1e-30) for i in ok)
out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), hand_model.state_dict().values()))

# 3. chained events, eager: 1,000 steps, records read every 100
model = mlp(1); opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=dev.type == "cuda")
tr = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False, track_memory=False,
                                         track_grad_norm=False))
good = [b for i, b in enumerate(data) if i not in bad]
for b in good[:5]:
    tr.train_step([b])
sync(); t0 = time.perf_counter()
times = []
recs = []
for i in range(1000):
    recs.append(tr.train_step([good[i % len(good)]]))
    if (i + 1) % 100 == 0:
        times += [r.time_s for r in recs]; recs = []
sync(); span = time.perf_counter() - t0
out["eager_all_positive"] = all(t is not None and math.isfinite(t) and t > 0 for t in times)
out["eager_sum_s"], out["eager_wall_s"] = sum(times[1:]), span
out["eager_sum_over_wall"] = sum(times) / span
clock = tr._clock
attrs = getattr(clock, "__dict__", None) or {k: getattr(clock, k, None) for k in getattr(type(clock), "__slots__", ())}
out["clock_attrs"] = {k: (len(v) if isinstance(v, (list, tuple, set, dict)) else v)
                      for k, v in attrs.items() if isinstance(v, (int, float, list, tuple, set, dict))}
# after evaluate: a start mark, times still positive
tr.evaluate([good[0]])
r = tr.train_step([good[1]]); r2 = tr.train_step([good[2]])
out["after_evaluate"] = [r.time_s, r2.time_s]

# captured: replays chained
if dev.type != "cuda":
    finish()
model = mlp(2); opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=dev.type == "cuda")
tr = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False, track_memory=False,
                                         track_grad_norm=False))
x, y = good[0]
step = tr.capture(x, y)
sync(); t0 = time.perf_counter()
recs = [step(x, y) for _ in range(300)]
sync(); span = time.perf_counter() - t0
ct = [r.time_s for r in recs]
out["capture_all_positive"] = all(t is not None and math.isfinite(t) and t > 0 for t in ct)
out["capture_sum_over_wall"] = sum(ct) / span
out["capture_median_ms"] = sorted(ct)[len(ct) // 2] * 1e3
finish()
