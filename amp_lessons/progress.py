"""The course's one progress bar: ``tqdm.auto`` (a live bar in a terminal and in Jupyter) that,
in a notebook, leaves one line of plain text behind when it closes.

A notebook's ``tqdm`` bar is a widget; once finished it stays in the saved notebook as a widget
output, which a static view (GitHub, nbviewer, a notebook opened without its kernel) can only
show as "run the notebook to use it". ``progress_bar`` shows the same live bar while it runs,
then replaces its output with ``"configurations: 16/16 in 03:12"``.
"""
from __future__ import annotations

from tqdm.auto import tqdm as _auto
from tqdm.std import tqdm as _plain

from amp_lessons.tables import plural

# tqdm.auto's bar is tqdm.notebook's in a Jupyter kernel; elsewhere it is tqdm's asyncio bar (a
# text bar, but not tqdm.std's class itself), which takes no `display` argument.
IN_NOTEBOOK = any(c.__module__ == "tqdm.notebook" for c in _auto.__mro__)


def progress_bar(iterable=None, **kwargs):
    """``tqdm.auto.tqdm(iterable, **kwargs)``: in a notebook, a live bar whose output becomes
    plain text when it closes (``summary_text``); elsewhere tqdm's own text bar."""
    if not IN_NOTEBOOK or kwargs.get("disable"):
        return _auto(iterable, **kwargs)
    return _NotebookBar(iterable, **kwargs)


def summary_text(desc: str, n: int, total, unit: str, elapsed: float) -> str:
    """What a closed bar leaves: ``"configurations: 16/16 in 03:12"``, ``"epoch 2: 23/23
    batches in 00:01"`` with a ``unit`` other than tqdm's ``"it"``, and ``" (stopped)"`` when it
    closed before its total."""
    if unit in ("", "it"):
        count = f"{n:,}" + (f"/{total:,}" if total else "")
    else:
        count = plural(n, unit) if not total else f"{n:,}/{plural(total, unit)}"
    stopped = " (stopped)" if total and n < total else ""
    return f"{desc + ': ' if desc else ''}{count} in {_plain.format_interval(elapsed)}{stopped}"


if IN_NOTEBOOK:  # tqdm picked its notebook bar: this is a Jupyter kernel
    class _NotebookBar(_auto):
        """tqdm's notebook bar shown under a display id, so closing it can replace the widget
        with its summary line (an ``update_display_data`` that nbclient and Jupyter save)."""

        def __init__(self, *args, **kwargs):
            kwargs["display"] = False
            kwargs.pop("delay", None)
            super().__init__(*args, **kwargs)
            self._handle = None
            if not self.disable:
                from IPython.display import display

                self._handle = display(self.container, display_id=True)
                self.displayed = True

        def close(self):
            handle, self._handle = getattr(self, "_handle", None), None
            super().close()
            if handle is not None:
                d = self.format_dict
                handle.update({"text/plain": summary_text(d["prefix"] or "", self.n, self.total,
                                                          d["unit"], d["elapsed"])}, raw=True)
                self.container.close()
