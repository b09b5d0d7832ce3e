"""One module per lesson: each lesson's experiments and the claims it decides, built on the engine.

Notebook NN imports ``amp_lessons.lessons.lNN_*`` and the engine, nothing else from the package."""
