"""What the course publishes: the articles' claims and their verdicts (``claims``), tables and
results (``report``), where each result came from (``provenance``), the notebook runner
(``notebooks``), the rehearsal on simulated cards and the static figure images (``snapshots``).
"""
