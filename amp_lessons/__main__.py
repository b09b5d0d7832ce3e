"""``python -m amp_lessons ...``: see ``amp_lessons.cli``."""
from amp_lessons.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
