"""Each lesson's experiments, one module per notebook (``lNN_*.py``). What produced a table a
notebook publishes is recorded when it is published (``publish.provenance``), not listed here."""
