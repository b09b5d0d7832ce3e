"""Number formats and precisions: format facts and casts (``formats``), precision names, autocast
and TF32 settings (``precision``), FP8 casts (``fp8``), the modes a measurement restores
(``modes``) and the optimizers that keep weights or state in low precision (``optim``).

Lessons 01, 02, 07 and 08 introduce them.
"""
