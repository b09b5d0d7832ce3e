"""The notebook contract of DESIGN.md, as code: the cells every lesson starts with.

Lesson authors build notebooks from these so the contract test (tests/test_contract.py) and the
notebooks never drift apart.
"""
REPO = "amp-lessons/amp-lessons"
BRANCH = "main"

SETUP_SOURCE = '''\
# Setup (the same in every lesson): install the course package on Colab or Kaggle only, then
# report this machine. Device, dtype and sizes come from `env`; no cell names a device itself.
import os, subprocess, sys
if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "amp-lessons @ git+https://github.com/amp-lessons/amp-lessons"], check=True)
try:
    import amp_lessons as al
except ModuleNotFoundError:  # another Jupyter, VS Code or Binder: say how to get the package
    raise ModuleNotFoundError("this lesson needs the course package: run  %pip install "
                              "'amp-lessons @ git+https://github.com/amp-lessons/amp-lessons'  "
                              "in a cell (or `make lab` in a clone), then restart the kernel") from None
env = al.setup()'''


def colab_url(notebook: str) -> str:
    return f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{notebook}"


def kaggle_url(notebook: str) -> str:
    return (f"https://kaggle.com/kernels/welcome?src=https://github.com/{REPO}/blob/{BRANCH}/"
            f"notebooks/{notebook}")


def badges(notebook: str) -> str:
    """Markdown for the Colab and Kaggle badges of one notebook file name."""
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"({colab_url(notebook)}) "
            f"[![Open In Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
            f"({kaggle_url(notebook)})")


def title_source(notebook: str, title: str, learn: list, hardware: str, intro: str = "") -> str:
    """The first cell: title, badges, what you will learn, what hardware it needs."""
    items = "\n".join(f"- {item}" for item in learn)
    return (f"# {title}\n\n{badges(notebook)}\n\n{intro}\n\n"
            f"**What you will learn**\n\n{items}\n\n**Hardware**: {hardware}\n").replace("\n\n\n", "\n\n")


def new_notebook(notebook: str, title: str, learn: list, hardware: str, parameters: str,
                 intro: str = ""):
    """A notebook holding the three contract cells; append the lesson, then a `## Checks` part."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook as _new

    nb = _new()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [
        new_markdown_cell(title_source(notebook, title, learn, hardware, intro)),
        new_code_cell(SETUP_SOURCE, metadata={"tags": ["setup"]}),
        new_code_cell(parameters, metadata={"tags": ["parameters"]}),
    ]
    return nb
