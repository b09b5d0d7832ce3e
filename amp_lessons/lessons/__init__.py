"""Each lesson's experiments (``lNN_*.py``), and ``PUBLISHED``: for every table a notebook
publishes (``report.publish``), the functions that produce it, outermost first, down to the code
that measured it (``python -m amp_lessons explain KEY`` prints them with file and line)."""
from typing import Dict, Sequence

TIMED = ("amp_lessons.measure.runner.run_configs", "amp_lessons.measure.runner.measure",
         "amp_lessons.measure.steps.hand_step", "amp_lessons.measure.timer.time_steps")
DISTRIBUTED = ("amp_lessons.measure.distributed.timed_repeats", "amp_lessons.measure.timer.time_steps")
VERDICT = ("amp_lessons.publish.report.publish_verdicts", "amp_lessons.publish.claims.decide")
_L = "amp_lessons.lessons."

# key (or a key prefix ending in ".") -> functions, outermost first
PUBLISHED: Dict[str, Sequence[str]] = {
    "lesson01.fp16-gradients": ("amp_lessons.numerics.formats.scale_report",
                                "amp_lessons.numerics.formats.collect_gradients"),
    "lesson02.fp32_vs_amp": (_L + "l02_amp_loop.compare_precisions",
                             "amp_lessons.train.recipes.train_digits", "amp_lessons.train.trainer.Trainer.fit"),
    "lesson03.presets": (_L + "l03_scaler.comparison_rows", _L + "l03_scaler.compare_presets",
                         _L + "l03_scaler.train_with_scaler", "amp_lessons.train.trainer.Trainer.train_step"),
    "lesson04.resnet": ("amp_lessons.measure.rows.published_rows", "amp_lessons.measure.rows.with_ratios",
                        _L + "l04_resnet50.lesson_configs") + TIMED,
    "lesson04.claim-r6": (_L + "l04_resnet50.compare_r6", _L + "l04_resnet50.lesson_configs") + TIMED,
    "lesson05.techniques": ("amp_lessons.tables.technique_report_rows",
                            _L + "l05_checkpointing.technique_table",
                            _L + "l05_checkpointing.technique_configs") + TIMED,
    "lesson05.frontier": (_L + "l05_checkpointing.frontier_rows",
                          _L + "l05_checkpointing.technique_table") + TIMED,
    "lesson05.card_advice": (_L + "l05_checkpointing.card_advice",
                             _L + "l05_checkpointing.technique_table") + TIMED,
    "lesson05.largest_batch": ("amp_lessons.tables.largest_batch_report_rows",
                               _L + "l05_checkpointing.largest_batch_table",
                               "amp_lessons.measure.cards.largest_per_card",
                               "amp_lessons.measure.search.fit_batch_memory",
                               "amp_lessons.measure.search.verified_batch",
                               "amp_lessons.measure.oom.memory_cap"),
    "lesson05.accumulation_plan": (_L + "l05_checkpointing.accumulation_plan",
                                   _L + "l05_checkpointing.largest_batch_table",
                                   "amp_lessons.measure.cards.largest_per_card",
                                   "amp_lessons.measure.search.verified_batch"),
    "lesson06.cnn-wrapping": (_L + "l06_multi_gpu.wrap_rows", _L + "l06_multi_gpu.wrap_configs",
                              "amp_lessons.measure.distributed.run_experiments",
                              "amp_lessons.measure.distributed.run_one") + DISTRIBUTED,
    "lesson06.transformer-scaling": ("amp_lessons.measure.distributed.SweepResult.published_rows",
                                     _L + "l06_multi_gpu.transformer_configs",
                                     "amp_lessons.measure.distributed.run_experiments",
                                     "amp_lessons.measure.distributed.run_one") + DISTRIBUTED,
    "lesson06.claim_r10c": (_L + "l06_multi_gpu.r10c_rows", _L + "l06_multi_gpu.zero_savings",
                            "amp_lessons.measure.distributed.run_experiments",
                            "amp_lessons.measure.distributed.run_one") + DISTRIBUTED,
    "lesson07.speed": (_L + "l07_fp8.speed_report_rows", "amp_lessons.measure.float8.speed_sweep",
                       "amp_lessons.measure.float8.measure_float8",
                       "amp_lessons.measure.timer.time_steps"),
    "lesson07.accuracy": (_L + "l07_fp8.accuracy_report_rows", _L + "l07_fp8.accuracy_runs",
                          "amp_lessons.measure.float8.train_gpt"),
    "lesson08.recipes": (_L + "l08_weights.report_rows", _L + "l08_weights.run_recipes",
                         "amp_lessons.numerics.optim.train_recipe", "amp_lessons.measure.timer.time_steps"),
    "lesson08.choice": (_L + "l08_weights.choice_table", _L + "l08_weights.memory_table",
                        _L + "l08_weights.run_recipes", "amp_lessons.numerics.optim.train_recipe"),
    "lesson09.summary": (_L + "l09_your_model.summary", "amp_lessons.doctor.run.doctor",
                         "amp_lessons.doctor.speed.speed_rows",
                         "amp_lessons.doctor.speed.time_precision",
                         "amp_lessons.measure.timer.time_steps"),
    "lesson09.resnet_vs_lesson04": (_L + "l09_your_model.agreement",
                                    "amp_lessons.doctor.speed.speed_rows",
                                    "amp_lessons.doctor.speed.time_precision",
                                    _L + "l09_your_model.lesson04_rows") + TIMED,
    "claims.": VERDICT,
}
