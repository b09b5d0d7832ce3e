"""Interleaved rounds for the benchmarks that read a cost as a paired ratio between variants
timed in the same round (``trainer_overhead.py``, ``instrument.py``): the order of the variants
in each round, and the loop that runs the rounds.

Why. On the H200 (issue 22's evening run) whatever ran first in a round, right after the rounds'
bookkeeping (a 2,000-resample bootstrap in Python), ran 3-5% slower. The old order alternated
(the reference first in even rounds, last in odd ones), so the reference paid for that slot in
half the rounds: its identical twin read -1.5% and -1.9% against it, the noise floor stalled at
2.6-2.8% however many rounds ran, and every cost read 1.5-2 points low. Here:

- each round begins with an untimed warm slot (the caller's throwaway copy of the reference
  loop), so no timed variant follows the pause between rounds;
- the order is balanced (``balanced``): rounds come in blocks of ``len(names)``; each block takes
  a fresh seeded permutation of the variants and runs its ``len(names)`` rotations, so over a
  block every variant runs in every position exactly once, and which of two variants runs first
  changes at random from block to block (no variant is systematically before another);
- the caller's bookkeeping (its noise floor and stopping rule) runs at block ends only, and the
  garbage collector is off during the rounds: a full collection before them, a collection of
  the young generations (all that the rounds allocated since the last one) at each block end,
  never in a timed slot.

``alternate`` is the old order (forward in even rounds, reversed in odd ones, meant to be run
without a warm slot), kept to reproduce old runs and to show in the tests what it does.
"""
import gc
import random
import time
from typing import Callable, List, Optional, Sequence

SCHEDULES = ("balanced", "alternate")


class Schedule:
    """The order of the variants in round ``r`` (``order(r)``), see the module's docstring.
    ``block``: the rounds after which each variant has been in each position equally often
    (``len(names)`` for ``balanced``, 2 for ``alternate``)."""

    def __init__(self, names: Sequence[str], kind: str = "balanced", seed: int = 0):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {kind!r}")
        if len(names) < 1 or len(set(names)) != len(names):
            raise ValueError(f"names: one or more distinct variants; got {list(names)!r}")
        self.names: List[str] = list(names)
        self.kind, self.seed = kind, seed
        self.block = len(self.names) if kind == "balanced" else 2
        self._rng = random.Random(seed)
        self._perms: List[List[str]] = []

    def order(self, r: int) -> List[str]:
        """The variants in the order they run in round ``r`` (0-based)."""
        if r < 0:
            raise ValueError(f"round must be >= 0; got {r}")
        if self.kind == "alternate":
            return list(self.names) if r % 2 == 0 else self.names[::-1]
        b, k = divmod(r, self.block)
        while len(self._perms) <= b:  # blocks drawn in order: the same seed, the same schedule
            perm = list(self.names)
            self._rng.shuffle(perm)
            self._perms.append(perm)
        perm = self._perms[b]
        return perm[k:] + perm[:k]

    def describe(self, rounds: int, warm_steps: int) -> dict:
        """What a result file records about the order the rounds ran in."""
        return {"kind": self.kind, "seed": self.seed, "block_rounds": self.block,
                "whole_blocks": rounds // self.block, "warm_steps": warm_steps,
                "bookkeeping": "at block ends, outside the timed slots; gc off in the rounds"}


def run_rounds(schedule: Schedule, time_slot: Callable[[str, int], None],
               warm_slot: Optional[Callable[[int], None]] = None, *, max_rounds: int,
               min_rounds: int = 2, at_block_end: Optional[Callable[[int], bool]] = None,
               deadline: Optional[float] = None,
               reserve: Callable[[float], float] = lambda round_s: 0.0,
               clock: Callable[[], float] = time.perf_counter) -> int:
    """Run interleaved rounds; returns how many ran.

    Each round: ``warm_slot(r)`` (untimed; skipped when None), then ``time_slot(name, r)`` for
    each variant in ``schedule.order(r)`` (the caller times and records). The garbage collector
    is off for the rounds (its state is restored at the end); its young generations are
    collected at each block end (with collection off, they hold everything allocated since the
    last one), before ``at_block_end(rounds)``, the caller's bookkeeping, which stops the rounds by
    returning True (only asked once ``min_rounds`` have run). ``deadline`` (a ``clock()`` time):
    after 2 rounds, stop when the next round, or at a block end the next whole block (so blocks
    stay whole where the time allows), would not end ``reserve(longest round)`` seconds before
    it. ``max_rounds`` stops in any case."""
    if max_rounds < 1 or min_rounds < 1:
        raise ValueError(f"max_rounds and min_rounds must be >= 1; got {max_rounds}, "
                         f"{min_rounds}")
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    rounds, longest = 0, 0.0
    try:
        while rounds < max_rounds:
            t0 = clock()
            if warm_slot is not None:
                warm_slot(rounds)
            for name in schedule.order(rounds):
                time_slot(name, rounds)
            rounds += 1
            longest = max(longest, clock() - t0)
            block_end = rounds % schedule.block == 0
            if block_end:
                gc.collect(1)
                if at_block_end is not None and rounds >= min_rounds and at_block_end(rounds):
                    break
            if deadline is not None and rounds >= 2:
                need = longest * (schedule.block if block_end else 1)
                if clock() + need + reserve(longest) > deadline:
                    break
    finally:
        if enabled:
            gc.enable()
    return rounds
