"""The step timers under their old name: ``amp_lessons.timing`` re-exports
``amp_lessons.bench.timer`` (the one timer); nothing is defined here."""
from .bench.timer import (NOISY_SPREAD, device_busy_ms, idle_fraction,  # noqa: F401
                          interval_union, repeat_spread, summarize_times, time_steps)
