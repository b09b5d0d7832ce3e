"""The doctor bench's cases: one small CPU reproduction per failure class the doctor diagnoses,
and healthy models on which it must raise no alarm (``amp_lessons.doctor.bench`` runs and scores
them; ``tests/test_doctor_bench.py`` and lesson 09 use ``CASES``)."""
from tests.doctor_bench.cases import CASES, HEALTHY, PROBLEMS  # noqa: F401
