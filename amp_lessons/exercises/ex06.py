"""Lesson 06's exercises: write the DDP + ``fully_shard`` script and run it with torchrun on two
CPU processes (gloo); predict the model state each rank holds under DDP, ZeRO-1 and FSDP2;
compute scaling efficiency as the lesson's sweep does."""
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from amp_lessons.tables import plural
from amp_lessons.exercises.check import (Check, close, graded, hint_book, hint_reader, is_blank,
                                         keyed, matching_mistake, not_a_function, passed,
                                         read_number, run_bounded, skipped, unanswered, within,
                                         wrong)

SCRIPT = "Exercise 1 (implement): DDP and fully_shard, run with torchrun"
STATE = "Exercise 3 (predict, then look): model state per rank"
EFFICIENCY = "Exercise 2 (implement): scaling efficiency"
MIB = 2 ** 20
PROCESSES = 2

HINTS = hint_book("ex06", {
    "script": (
        "Section 2 wrote the real API out once (its wrap function): each TODO is one of its "
        "pieces, one to five lines. TODO 1 joins the process group every rank shares (the CPU "
        "backend is named in the TODO); TODO 2 uses the wrapper that averages gradients during "
        "backward; TODO 3 uses FSDP2's fully_shard with a mixed-precision policy, on the small "
        "modules first. print(ex06.full_script(my_script)) shows the head your body runs after.",
        "TODO 1: torch.distributed's init_process_group with the backend 'gloo'. TODO 2: wrap a "
        "fresh make_model() in DDP. TODO 3: fsdp = make_model(); a MixedPrecisionPolicy whose "
        "parameters are gathered in bf16 and gradients reduced in fp32; fully_shard each "
        "nn.Linear of fsdp with it, then fsdp itself.",
        "dist.init_process_group('gloo'); ddp = DDP(make_model()); fsdp = make_model(); policy = "
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32); "
        "for layer in fsdp: if isinstance(layer, nn.Linear): fully_shard(layer, mp_policy=policy); "
        "then fully_shard(fsdp, mp_policy=policy).",
    ),
    "efficiency": (
        "Efficiency compares what n processes really did with what n perfect copies of one "
        "process would have done. Which two throughputs does that compare?",
        "n perfect copies of one process would reach n times its throughput. Efficiency is the "
        "measured throughput of the n processes over that ideal; the speed-up alone is not it.",
        "return per_s_n / (n * per_s_1)",
    ),
    "state": (
        "Count bytes per parameter first: in which dtype are the weights, the gradients and "
        "AdamW's state kept, and how many tensors does AdamW keep per parameter? Then, for each "
        "strategy, read the table at the top of this section: which of the three does it split "
        "across the N ranks?",
        "In fp32: 4 bytes of weight + 4 of gradient + 8 of AdamW state (two moments) make 16 "
        "bytes per parameter. DDP splits none of them; ZeRO stage 1 splits only the optimizer "
        "state; FSDP2 splits all three. Divide bytes by 2**20 for MiB.",
        "With n = n_params: ddp 16 * n / 2**20; zero (4 + 4 + 8 / N) * n / 2**20; fsdp2 "
        "16 * n / N / 2**20 MiB per rank.",
    ),
})


hint = hint_reader(HINTS, __name__)

_HEAD = '''\
# Run by torchrun, one copy per process (two CPU processes, gloo):
#   python -m torch.distributed.run --standalone --nproc_per_node 2 this_file.py OUT.json
import json, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def train(model, rank, autocast, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)  # each rank trains on its own batches
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses

'''

_STUB_BODY = '''\
# TODO 1: join the process group (backend "gloo": CPU processes)
...
rank = dist.get_rank()

# TODO 2: wrap make_model() in DDP, then train it under autocast
ddp = ...
ddp_losses = train(ddp, rank, autocast=True)

# TODO 3: shard make_model() with fully_shard: each nn.Linear first, then the whole model,
#         with a MixedPrecisionPolicy: parameters gathered in bf16, gradients reduced in fp32
fsdp = ...
fsdp_losses = train(fsdp, rank, autocast=False)  # the policy casts: no autocast needed
'''

REFERENCE_BODY = '''\
dist.init_process_group("gloo")
rank = dist.get_rank()

ddp = DDP(make_model())  # gradients are averaged across ranks during backward
ddp_losses = train(ddp, rank, autocast=True)

fsdp = make_model()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in fsdp:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mp_policy=policy)  # one unit per layer: gathered one at a time
fully_shard(fsdp, mp_policy=policy)           # the root: whatever is left, and the hooks
fsdp_losses = train(fsdp, rank, autocast=False)
'''

_TAIL = '''
# The report the check reads (leave as is)
def local(p):
    return p.to_local() if hasattr(p, "to_local") else p
inner = ddp.module if isinstance(ddp, DDP) else ddp
report = {"rank": rank, "world_size": dist.get_world_size(), "ddp": isinstance(ddp, DDP),
          "ddp_losses": ddp_losses, "fsdp_losses": fsdp_losses,
          "ddp_checksum": sum(float(p.detach().double().sum()) for p in inner.parameters()),
          "fsdp_local": sum(local(p).numel() for p in fsdp.parameters()),
          "full": sum(p.numel() for p in make_model().parameters()),
          "fsdp_units": sum(isinstance(m, FSDPModule) for m in fsdp.modules()),
          "fsdp_output": str(fsdp(torch.randn(2, 32)).dtype)}
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, report)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(reports, f)
dist.destroy_process_group()
'''

STUB = _HEAD + _STUB_BODY + _TAIL
REFERENCE = _HEAD + REFERENCE_BODY + _TAIL
WRONG_SCRIPTS = {
    "no DDP wrapper": REFERENCE.replace("ddp = DDP(make_model())", "ddp = make_model()"),
    "root only": REFERENCE.replace("        fully_shard(layer, mp_policy=policy)", "        pass"),
}


# torchrun's own wrappers around a worker's failure: never the cause
_WRAPPERS = ("ChildFailedError", "torch.distributed.elastic", "SignalException",
             "FAILED", "Root Cause", "error_file", "traceback :")
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt)|Traceback)\b.*")


def _last_error(text: str) -> str:
    """The cause of a failed torchrun, in one line: a line that names NCCL (the usual reason a
    script fails on CPU processes) if any, else the first exception a worker raised (``Name:
    message``), never torchrun's ``ChildFailedError`` wrapper around it; else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln) and ":" in ln
              and not ln.startswith("Traceback") and not any(w in ln for w in _WRAPPERS)]
    nccl = [ln for ln in errors if "nccl" in ln.lower()] or \
           [ln for ln in lines if "nccl" in ln.lower() and not any(w in ln for w in _WRAPPERS)]
    if nccl:
        return nccl[0][:300]
    if errors:
        return errors[0][:300]
    fallback = [ln for ln in lines if "Error" in ln and ":" in ln]
    return (fallback or lines or ["no output"])[-1][:300]


def run_script(source: str, timeout_s: float = 180.0) -> dict:
    """Write ``source`` to a temporary file and run it with torchrun on two CPU processes (gloo,
    no GPU visible), for at most ``timeout_s`` seconds: on a time-out or an exception torchrun
    and both workers are ended (``check.run_bounded``). Returns ``{"returncode", "reports",
    "error"}`` (returncode None on a time-out)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "ddp_fsdp.py", Path(tmp) / "out.json"
        path.write_text(source)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                              if p),
                   PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={PROCESSES}", str(path), str(out)]
        for attempt in range(2):  # once more if another job took the rendezvous port
            returncode, stdout, stderr = run_bounded(cmd, timeout_s, env=env, cwd=tmp)
            if returncode is None:
                return {"returncode": None, "reports": None,
                        "error": f"the script did not finish within {timeout_s:.0f} s; torchrun "
                                 f"and its workers were ended"}
            busy = re.search(r"address already in use|EADDRINUSE|rendezvous", stderr, re.I)
            if returncode == 0 or not busy:
                break
        try:
            reports = json.loads(out.read_text()) if out.exists() else None
        except ValueError:
            reports = None
        if returncode and _aborted_at_exit(stderr, reports):
            returncode = 0  # the work and its report are complete: see _aborted_at_exit
        return {"returncode": returncode, "reports": reports,
                "error": _last_error(stderr + "\n" + stdout) if returncode else ""}


def _aborted_at_exit(stderr: str, reports) -> bool:
    """A rank that wrote its part of a complete report and then died in C++ teardown
    ("terminate called without an active exception": a gloo thread still joinable when the
    interpreter exits; seen in about half the runs under pytest on a 2-core machine, never in
    the script's own work) has done everything that is graded."""
    return ("terminate called without an active exception" in stderr
            and isinstance(reports, list) and len(reports) == PROCESSES
            and all(isinstance(r, dict) for r in reports))


def full_script(body: str) -> str:
    """The whole script: the fixed head (imports, model, training loop), ``body`` (the part the
    learner writes: process group, DDP, fully_shard) and the fixed report."""
    return _HEAD + body.strip("\n") + "\n" + _TAIL


STUB_BODY = _STUB_BODY


_PLACEHOLDERS = ("ddp = ...", "fsdp = ...")  # the stub's TODO 2 and TODO 3, as it has them


def still_template(source: str) -> bool:
    """True when ``source`` is the stub (``STUB`` or ``STUB_BODY``, whatever the blank lines) or
    still holds one of its unanswered TODOs: a line that is exactly ``ddp = ...`` or
    ``fsdp = ...``, or TODO 1's bare ``...`` with no ``init_process_group`` call anywhere. A
    ``...`` or ``= ...`` elsewhere in a finished script is not the template."""
    lines = [ln.strip() for ln in source.splitlines()]
    code = [ln for ln in lines if ln]
    if code in ([ln for ln in map(str.strip, STUB.splitlines()) if ln],
                [ln for ln in map(str.strip, _STUB_BODY.splitlines()) if ln]):
        return True
    if any(ln in _PLACEHOLDERS for ln in lines):
        return True
    return "..." in lines and "init_process_group" not in source


@graded
def check_script(source: str, timeout_s: float = 180.0) -> Check:
    """Run the learner's script with torchrun on two CPU processes and grade what its report
    says: DDP kept the ranks' weights identical, FSDP2 sharded them (one unit per Linear plus the
    root) and gathered them in bf16, every loss finite. ``source`` is the whole script or only
    its body (``STUB_BODY`` filled in: see ``full_script``). Skipped, saying why, where this
    torch cannot run FSDP2 correctly on a CPU (``distributed.fsdp2_problem``: torch < 2.9)."""
    hint = HINTS["script"]
    if not isinstance(source, str):
        return unanswered(SCRIPT, hint) if is_blank(source) else wrong(
            SCRIPT, f"expected the script as a string; got {type(source).__name__}", hint)
    if not source.strip() or still_template(source):
        return unanswered(SCRIPT, hint)
    if "def make_model" not in source:
        source = full_script(source)
    from amp_lessons.measure.distributed import fsdp2_problem
    problem = fsdp2_problem("cpu")
    if problem:  # the grader's two processes are CPU ones
        return skipped(SCRIPT, f"cannot be run here: {problem}")
    result = run_script(source, timeout_s)
    if result["returncode"] != 0 or not result["reports"]:
        error = result["error"]
        why = hint
        if "nccl" in error.lower():
            why = hint.after("NCCL connects GPUs; these are two CPU processes with no GPU "
                             "visible: join the process group with the CPU backend, 'gloo'")
        elif result["returncode"] is None:
            why = hint.after("a script that never ends is usually waiting on a collective that "
                             "not every rank reaches: every rank must run the same calls, in the "
                             "same order")
        return wrong(SCRIPT, f"torchrun failed: {error}", why)
    return grade_reports(result["reports"])


def grade_reports(reports: Sequence[Mapping]) -> Check:
    """Grade the ranks' reports of a finished script run (see ``check_script``); a report that
    lacks a field or holds another type is graded wrong, not a crash."""
    try:
        return _grade_reports(reports)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return wrong(SCRIPT, f"the ranks' report is incomplete ({type(exc).__name__}: {exc}): "
                     f"leave the script's report part as it is", HINTS["script"])


def _grade_reports(reports: Sequence[Mapping]) -> Check:
    hint = HINTS["script"]
    if len(reports) != PROCESSES or any(r["world_size"] != PROCESSES for r in reports):
        return wrong(SCRIPT, f"expected {PROCESSES} ranks; the report has {len(reports)}", hint)
    losses = [x for r in reports for x in r["ddp_losses"] + r["fsdp_losses"]]
    if not all(math.isfinite(x) for x in losses):
        return wrong(SCRIPT, "a loss is inf or NaN", hint)
    sums = [r["ddp_checksum"] for r in reports]
    if not all(r["ddp"] for r in reports) or not all(map(math.isfinite, sums)) \
            or not max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0])):
        return wrong(SCRIPT, "after training, the ranks' DDP weights differ",
                     hint.after("each rank saw other batches and no one averaged the "
                                "gradients: wrap the model in DDP(...) so backward all-reduces "
                                "them"))
    full, local = reports[0]["full"], [r["fsdp_local"] for r in reports]
    if sum(local) > 1.01 * full or max(local) > 0.6 * full:
        return wrong(SCRIPT, f"each rank holds {max(local):,} of the {full:,} FSDP parameters: "
                     f"nothing is sharded", hint.after(
                         "fully_shard(module) replaces the parameters with DTensors split across "
                         "the ranks: call it on fsdp's layers and on fsdp"))
    units = reports[0]["fsdp_units"]
    if units < 4:
        return wrong(SCRIPT, f"{units} FSDP2 unit(s); expected one per nn.Linear plus the root",
                     hint.after("call fully_shard on each nn.Linear before the whole model: one "
                                "big unit gathers every parameter at once, which is what "
                                "sharding tries to avoid"))
    if reports[0]["fsdp_output"] != "torch.bfloat16":
        return wrong(SCRIPT, f"the FSDP2 model computes in {reports[0]['fsdp_output']}",
                     hint.after("pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                                "reduce_dtype=torch.float32) to every fully_shard call"))
    return passed(SCRIPT, f"{PROCESSES} ranks: DDP weights identical after training; FSDP2 "
                  f"holds {local} of {full:,} parameters per rank in {plural(units, 'unit')}, computing "
                  f"in bf16")


def _mib(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def reference_state_per_rank(n_params: int, world_size: int) -> dict:
    """The reference solution, in MiB: fp32 weights (4 B), gradients (4 B) and AdamW's two
    moments (8 B); ZeRO-1 shards the moments, FSDP2 all three."""
    n = n_params / MIB
    return {"ddp": 16 * n, "zero": 8 * n + 8 * n / world_size, "fsdp2": 16 * n / world_size}


def _common_factor(ratios: Mapping[str, float]) -> Optional[float]:
    """The one factor every answer is off by (within 10% of each other), or None."""
    values = list(ratios.values())
    if len(values) < 2 or min(values) <= 0:
        return None
    first = values[0]
    return first if all(within(v, first, 0.10) for v in values) else None


def _unit_mistake(factor: float) -> str:
    """The hint for answers whose splits across ranks are right but all off by ``factor``."""
    if within(factor, MIB, 0.10):
        return "those are bytes: the question asks for MiB, bytes / 2**20"
    if within(factor, 1 / 1024, 0.10):
        return "those are GiB: the question asks for MiB, 1,024 of them to a GiB"
    return ("all three are off by the same factor, so each strategy's split is right: the "
            "bytes per parameter are not (count what training keeps per parameter, and each "
            "one's dtype)")


@graded
def check_state_per_rank(answer: Mapping[str, float], measured: Mapping[str, float],
                         world_size: int) -> Check:
    """Grade ``answer`` ({"ddp", "zero", "fsdp2"} -> MiB of parameters + gradients + optimizer
    state on one rank) against ``measured`` (the sweep's ``model_state_mib`` per strategy at
    ``world_size`` processes), within 10% (ZeRO splits whole tensors, so shards are uneven)."""
    hint = HINTS["state"]
    why = {"ddp": "DDP replicates everything: all 16 bytes per parameter on every rank",
           "zero": "ZeRO stage 1 splits only the optimizer state: 4 + 4 + 8/N bytes",
           "fsdp2": "FSDP2 splits weights, gradients and optimizer state: 16/N bytes"}
    if is_blank(answer):
        return unanswered(STATE, hint)
    given = keyed(answer, why)
    if given is None:
        return wrong(STATE, f"answer must be a dict with the keys {', '.join(why)}", hint)
    answer = given
    if all(measured.get(k) is None for k in why):
        return skipped(STATE, "none of the three strategies ran here")
    said = {}
    for key in why:
        said[key], bad = read_number(answer[key], key)
        if bad:
            return wrong(STATE, f"{bad} (MiB)", hint)
    graded = [k for k in why if measured.get(k) is not None]
    reveal = ", ".join(f"{k} {_mib(measured[k])} MiB" for k in graded) + \
        f" per rank at {world_size} process(es)"
    off = [k for k in graded if not within(said[k], measured[k], 0.10)]
    if off:
        key = off[0]
        way = "too much" if said[key] > measured[key] else "too little"
        message = (f"{key} at {world_size} process(es): {_mib(said[key])} MiB is {way} "
                   f"(more than 10% off what the ranks measured)")
        factor = _common_factor({k: said[k] / measured[k] for k in graded if measured[k]})
        if len(off) > 1 and factor is not None:  # every strategy off alike: not a split
            return wrong(STATE, message + "; every strategy is off by the same factor",
                         hint.after(_unit_mistake(factor)), reveal)
        return wrong(STATE, message, hint.after(why[key]), reveal)
    return passed(STATE, ", ".join(f"{k} {_mib(measured[k])} MiB" for k in why
                                   if measured.get(k) is not None) + " per rank")


def reference_efficiency(per_s_1: float, per_s_n: float, n: int) -> float:
    """The reference solution: N processes' throughput over N times one process's."""
    return per_s_n / (n * per_s_1)


WRONG_EFFICIENCY = {"the speed-up": lambda per_s_1, per_s_n, n: per_s_n / per_s_1,
                    "the inverse": lambda per_s_1, per_s_n, n: n * per_s_1 / per_s_n,
                    "a percentage": lambda per_s_1, per_s_n, n: 100 * per_s_n / (n * per_s_1)}
EFFICIENCY_MISTAKES = {
    "the speed-up": "that is the speed-up; divide it by the number of processes",
    "the inverse": "that is the inverse: what the n processes measured goes on top, the ideal "
                   "(n times one process) below",
    "a percentage": "that is the efficiency in percent: return the fraction (0.9, not 90), as "
                    "the sweep's table does",
}


EFFICIENCY_REL = 1e-5  # float32 arithmetic (a tensor answer) is good to about 1e-7

# Throughputs the grader adds to the sweep's own rows: (processes, the n-process run's throughput
# over n times one process's). Where the sweep ran on one process only (one GPU, or a CPU whose
# sweep was cut short), these alone grade the function, through the sweep's own arithmetic.
PROBES = ((2, 0.93), (4, 1.08), (8, 0.61))


def sweep_efficiency(per_s_1: float, per_s_n: float, n: int) -> float:
    """The scaling efficiency the lesson's sweep reports for a configuration that ran at
    ``per_s_1`` samples/s on one process and ``per_s_n`` on ``n``: computed by the sweep's own
    code (``measure.distributed.SweepResult.summary``) on two made-up runs of one sample per
    step, so that the exercise is graded by the lesson's definition, wherever it runs."""
    from amp_lessons.measure.distributed import SweepResult

    def rows(world, per_s):
        step_ms = 1000.0 * world / per_s  # per_s = world * batch / step time, batch 1
        return [{"label": "probe", "world_size": world, "rank": r, "model": "probe",
                 "strategy": "ddp", "precision": "fp32", "unit": "samples", "fsdp_wrap": None,
                 "fsdp_units": None, "batch_size": 1, "step_ms": step_ms, "peak_gib": None,
                 "param_mib": 0.0, "grad_mib": 0.0, "optimizer_state_mib": 0.0,
                 "losses": [0.0], "spread": None, "peak_spread": None} for r in range(world)]
    summary = SweepResult(rows(1, per_s_1) + rows(n, per_s_n), backend="gloo",
                          launched=n).summary()
    return next(r["efficiency"] for r in summary if r["world_size"] == n)


def _efficiency_inputs(summary: Sequence[Mapping]) -> list:
    """(label, inputs, the sweep's efficiency) for every multi-process row of ``summary`` with
    a one-process row of its configuration, then for ``PROBES`` on each one-process row (or on
    a made-up one where the sweep has none)."""
    single = {r["label"]: r["per_s"] for r in summary if r["world_size"] == 1 and r.get("per_s")}
    out = [(f"{r['label']} on {plural(r['world_size'], 'process', 'processes')}",
            (single[r["label"]], r["per_s"], r["world_size"]), r["efficiency"])
           for r in summary if r["world_size"] > 1 and r.get("efficiency") is not None
           and r["label"] in single]
    for label, per_s_1 in (list(single.items())[:2] or [("a configuration", 250.0)]):
        for n, e in PROBES:
            inputs = (per_s_1, n * e * per_s_1, n)
            out.append((f"{label} if {plural(n, 'process', 'processes')} had run at {inputs[1]:,.4g}/s", inputs,
                        sweep_efficiency(*inputs)))
    return out


@graded
def check_efficiency(fn: Callable, summary: Sequence[Mapping]) -> Check:
    """Grade ``fn(per_s_1, per_s_n, n)`` against the ``efficiency`` of every multi-process row of
    a sweep's ``summary()`` (its ``label``, ``world_size``, ``per_s``) and, so that a one-GPU or
    a one-process run grades it too, against ``sweep_efficiency`` (the sweep's own arithmetic)
    on ``PROBES``, within a relative ``EFFICIENCY_REL``: a number of any type (a float, a NumPy
    scalar, a one-value tensor of any float dtype) counts. Only arithmetic: no process runs."""
    hint = HINTS["efficiency"]
    if (stub := not_a_function(EFFICIENCY, fn, hint)) is not None:
        return stub
    cases = _efficiency_inputs(summary)  # the references first
    answers = []
    for label, inputs, want in cases:
        try:
            got = fn(*inputs)
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
            return wrong(EFFICIENCY, f"{type(exc).__name__}: {exc}", hint)
        if is_blank(got):
            return unanswered(EFFICIENCY, hint)
        v, bad = read_number(got, "the efficiency")
        if bad:
            return wrong(EFFICIENCY, f"{label}: {bad}", hint)
        answers.append((label, inputs, want, v))
    off = [a for a in answers if not close(a[3], a[2], EFFICIENCY_REL)]
    if off:
        label, inputs, want, v = off[0]
        known = matching_mistake(  # on every row: at 2 processes speed-up / (n - 1) is the
            {name: lambda inputs, bad=bad: bad(*inputs)  # speed-up itself
             for name, bad in WRONG_EFFICIENCY.items()},
            [(inputs, v) for _, inputs, _, v in answers],
            lambda a, b: close(b, a, EFFICIENCY_REL))
        why = hint.after(EFFICIENCY_MISTAKES[known]) if known else hint
        return wrong(EFFICIENCY, f"{label}: your function gives {v:.6g}, which is not the "
                     f"sweep's efficiency", why, f"{want:.6g} for per_s_1={inputs[0]:.6g}, "
                     f"per_s_n={inputs[1]:.6g}, n={inputs[2]}")
    ran = sum(1 for label, *_ in answers if " if " not in label)
    return passed(EFFICIENCY, f"matches the sweep on {plural(ran, 'measured row')} and "
                  f"{plural(len(answers) - ran, 'made-up one')}")
