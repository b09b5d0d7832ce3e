"""The measurement engine: one concept per module.

- ``config``: what one measured step is (``BenchConfig``) and the standard settings (``STANDARD``);
- ``steps``: the model, the optimizer and the training step a row times (``hand_step``...);
- ``timer``: the one timer (``time_steps``), the GPU's busy time and the repeat spread;
- ``memory``: memory accounting (bytes per storage, saved activations, the step's breakdown);
- ``counted``: memory counted tensor by tensor where there is no peak counter (a CPU);
- ``oom``: the one out-of-memory classifier, the one free-memory answer, memory caps;
- ``runner``: one configuration measured (``measure``), many (``run_configs``), loops compared;
- ``rows``: the measured row (``MeasuredRow``), ratios, the published form of a table, ``noisy``;
- ``search``: a batch that fits, memory fitted against batch, the largest batch under a cap;
- ``cards``: the largest batch per simulated card (fit, then verify under each card's cap);
- ``accumulation``: gradient accumulation's memory and equivalence;
- ``float8``: FP8 support, float8 conversion, the MLP-stack speed sweep, the small GPT runs;

Everything public is importable from ``amp_lessons.measure`` itself.
"""
from amp_lessons.measure.config import (COMPILE_MODES, LOOPS, MODELS, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISION_NAMES,
                     STANDARD, BenchConfig, settings_caption, skip_reason, standard_settings)
from amp_lessons.measure.memory import (GIB, SavedActivations, memory_breakdown, optimizer_state_tensors,
                     storage_key, tensor_bytes)
from amp_lessons.measure.oom import free_bytes, free_memory, is_out_of_memory, memory_cap
from amp_lessons.measure.rows import (DEFAULT_COLUMNS, MEMORY_COLUMNS, MeasuredRow, find_row, noisy, published_rows,
                   ratio, results_document, with_ratios)
from amp_lessons.measure.runner import ROW_KEYS, compare_loops, measure, overhead_noise, run_configs
from amp_lessons.measure.search import LargestBatch, batch_size_for, fit_batch_memory, largest_batch
from amp_lessons.measure.steps import Step, build_model, build_optimizer, cuda_graph_step, hand_step, trainer_step
from amp_lessons.measure.timer import (NOISY_SPREAD, device_busy_ms, idle_fraction, interval_union, repeat_spread,
                    summarize_times, time_steps, wall_clock)

__all__ = [name for name in dir() if not name.startswith("_") and name not in (
    "config", "memory", "oom", "rows", "runner", "search", "steps", "timer")]
