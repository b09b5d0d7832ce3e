"""``python -m amp_lessons ...``: see ``amp_lessons.cli``."""
import sys

if __name__ == "__main__":
    try:  # Ctrl-C while torch is still being imported: one line, as everywhere else
        from amp_lessons.cli import main
    except KeyboardInterrupt:
        print("python -m amp_lessons: interrupted (Ctrl-C) while starting; nothing was written",
              file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(main())
