"""Number formats and precisions: format facts and casts (``formats``), precision names, autocast
and TF32 settings (``precision``), FP8 casts (``fp8``) and the modes a measurement restores
(``modes``).

Lessons 01, 02 and 07 introduce them.
"""
