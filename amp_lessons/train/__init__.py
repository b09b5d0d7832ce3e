"""Training: the shared trainer a learner reads (``trainer``), its precision policy and scaler
settings, what it records, and training-checkpoint files.

Lesson 02 introduces the trainer; lessons 03-05 train through it.
"""
