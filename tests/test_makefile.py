"""The Makefile's set-ups, read with `make -n` (nothing is installed): the default one (PyPI's
torch, built for CUDA) and `CPU=1` (PyTorch's CPU-only wheels from PyTorch's own index), each in
a venv of its own so that neither finds the other's torch already installed."""
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str, target: str = "lab", env=None) -> list:
    """The commands ``make -n -B TARGET ARGS`` would run on a fresh clone (``-B``: as if nothing
    were built yet), one a line (continuations joined)."""
    proc = subprocess.run(["make", "-n", "-B", "--no-print-directory", target, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.replace("\\\n", " ").splitlines()


def _pins() -> list:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [x for x in lines if re.match(r"^(torch|torchvision)==", x)]


def test_cpu_set_up_takes_the_pinned_torch_from_pytorchs_cpu_index_into_its_own_venv():
    cmds = dry_run("CPU=1")
    cpu = [c for c in cmds if CPU_INDEX in c]
    assert len(cpu) == 1, cmds
    assert cpu[0].startswith(".venv-cpu/bin/python -m pip install") and "--no-deps" in cpu[0]
    assert f"--index-url {CPU_INDEX}" in cpu[0]
    assert cpu[0].split()[-2:] == _pins() and len(_pins()) == 2
    rest = next(c for c in cmds if "-c constraints.txt -e" in c)
    assert rest.startswith(".venv-cpu/bin/python") and cmds.index(rest) > cmds.index(cpu[0])
    check = next(c for c in cmds if "torch.version.cuda" in c)  # a CUDA torch fails the set-up
    assert check.startswith(".venv-cpu/bin/python -c") and cmds.index(check) > cmds.index(rest)
    assert "touch .venv-cpu/.amp-lessons-installed" in cmds
    assert any(c.startswith(".venv-cpu/bin/jupyter lab") for c in cmds)
    assert not any(re.search(r"(^|[ /])\.venv/", c) for c in cmds), "CPU=1 touched .venv"


@pytest.mark.parametrize("args", [(), ("CPU=0",), ("CPU=",)], ids=["default", "CPU=0", "CPU="])
def test_default_set_up_uses_pypi_torch_in_dot_venv(args):
    cmds = dry_run(*args)
    assert not any(CPU_INDEX in c or "torch.version.cuda" in c for c in cmds)
    assert "touch .venv/.amp-lessons-installed" in cmds
    assert not any(".venv-cpu" in c for c in cmds)


def test_the_colab_venv_reuses_the_torch_of_the_set_up_it_belongs_to():
    default = " ".join(dry_run(target="colab"))
    cpu = " ".join(dry_run("CPU=1", target="colab"))
    assert "-m venv .venv-colab" in default and "/.venv/lib/" in default
    assert "-m venv .venv-cpu-colab" in cpu and "/.venv-cpu/lib/" in cpu
    assert ".venv-colab/" not in cpu and "/.venv/lib/" not in cpu


def test_the_oldest_torch_venv_pins_pyprojects_lower_bound_and_reuses_the_rest():
    """`make test-oldest`: torch and torchvision at the oldest release pyproject.toml admits, in
    a venv of their own; the other packages and the course come from the set-up's venv."""
    floor = re.search(r'"torch>=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pins = [x for x in (ROOT / "tests/oldest_versions.txt").read_text().splitlines()
            if x and not x.startswith("#")]
    assert pins[0].startswith(f"torch=={floor}.") and pins[1].startswith("torchvision==")
    default = dry_run(target="test-oldest")
    cpu = " ".join(dry_run("CPU=1", target="test-oldest"))
    joined = " ".join(default)
    assert "-m venv .venv-oldest" in joined and "/.venv/lib/" in joined
    assert "-r tests/oldest_versions.txt" in joined and CPU_INDEX not in joined
    assert "-m venv .venv-cpu-oldest" in cpu and f"--index-url {CPU_INDEX}" in cpu
    run = [c for c in default if "pytest" in c]
    assert run and ".venv-oldest/bin/python -m pytest" in run[-1]
    assert "tests/test_policies.py" in run[-1] and "tests/test_distributed.py" in run[-1]


def test_clean_removes_both_set_ups_and_git_ignores_them():
    (clean,) = [c for c in dry_run(target="clean") if c.startswith("rm -rf")]
    assert set(clean.split()) >= {".venv", ".venv-colab", ".venv-cpu", ".venv-cpu-colab",
                                  ".venv-oldest", ".venv-cpu-oldest"}
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert {".venv/", "/.venv-colab/", "/.venv-cpu/", "/.venv-cpu-colab/", "/.venv-oldest/",
            "/.venv-cpu-oldest/"} <= set(ignored)


def test_readme_documents_the_cpu_only_path_and_its_size():
    readme = (ROOT / "README.md").read_text()
    assert "make lab CPU=1" in readme and CPU_INDEX in readme and ".venv-cpu" in readme
    part = readme[readme.index("Without an NVIDIA GPU"):][:1500]
    assert "CPU-only" in part and re.search(r"about [\d.]+ GiB", part)
    assert "make clean && make lab CPU=1" not in readme  # its own venv: nothing to clean first


@pytest.mark.skipif(platform.system() != "Linux", reason="the display rule is Linux's here")
def test_lab_opens_a_browser_only_where_there_is_a_display():
    bare = {k: v for k, v in os.environ.items()
            if k not in ("DISPLAY", "WAYLAND_DISPLAY", "OPEN_BROWSER")}

    def opens(*args, **env):
        (lab,) = [c for c in dry_run(*args, env={**bare, **env}) if "jupyter lab" in c]
        return re.search(r"--ServerApp.open_browser=(\w+)", lab).group(1)

    assert opens() == "False"  # a server or a container: print the URL, no browser attempt
    assert opens(DISPLAY=":0") == "True" and opens(WAYLAND_DISPLAY="wayland-0") == "True"
    assert opens("OPEN_BROWSER=True") == "True" and opens("OPEN_BROWSER=False", DISPLAY=":0") == "False"
    assert opens(OPEN_BROWSER="True") == "True"  # from the environment too


def _pytest_runs(target: str) -> list:
    return [c for c in dry_run(target=target) if " -m pytest " in c]


def test_make_test_runs_every_stage_of_the_targets_it_stands_for():
    """`make test` runs what `make unit`, `make notebooks`, `make browser`, `make colab` and
    `make test-oldest` run; the serial and browser tests in one process, `-m "serial or browser"`,
    in place of unit's serial run and browser's run."""
    runs = _pytest_runs("test")
    unit, serial = _pytest_runs("unit")
    assert unit in runs and '-m "serial and not browser"' in serial and "-n " not in serial
    (browser,) = _pytest_runs("browser")
    assert "-m browser" in browser and browser not in runs
    (alone,) = [c for c in runs if '-m "serial or browser"' in c]
    assert alone.startswith(".venv/bin/python -m pytest -q tests ") and "-n " not in alone
    for target in ("notebooks", "colab", "test-oldest"):  # (the notebooks' times: see below)
        shared = [c.replace("AMP_LESSONS_TIMED_ALONE=1", "AMP_LESSONS_TIMED_ALONE=0")
                  for c in _pytest_runs(target)]
        assert all(c in runs for c in shared), target
    assert len(runs) == 6  # unit, serial and browser, notebooks, colab (2), oldest


def test_what_times_itself_runs_alone_and_the_rest_side_by_side():
    """The tests that assert on wall time (serial, browser) run with nothing beside them; the
    three sessions `make test` runs at once select none of them."""
    text = (ROOT / "Makefile").read_text()
    (block,) = re.findall(r"^\t@\$\(MAKE\) --no-print-directory -j3 \$\(OUTPUT_SYNC\) (.*)$", text,
                          flags=re.M)
    assert block.split() == ["notebooks", "colab-workers", "test-oldest", "SHARED=1"]
    for target in block.split()[:3]:
        for run in _pytest_runs(target):
            assert '-m "not browser and not serial"' in run or run.endswith(" notebooks"), run
    runs = _pytest_runs("test")
    alone = [c for c in runs if "-n " not in c]
    assert len(alone) == 2 and all('serial' in c for c in alone)
    (notebooks,) = [c for c in runs if c.endswith(" notebooks")]
    assert "AMP_LESSONS_TIMED_ALONE=0" in notebooks  # beside two sessions: its times state nothing
    assert all(runs.index(c) < runs.index(notebooks) for c in alone)


def test_make_test_builds_its_venvs_at_once_and_the_oldest_in_the_background():
    """A plain `make test` (the README's command, and `.ci/run`'s) builds .venv and .venv-colab at
    once (a sub-make with -j2), and .venv-oldest in the background at the lowest CPU priority,
    waited for (its exit status checked) before the stage that needs it."""
    text = (ROOT / "Makefile").read_text()
    (venvs,) = re.findall(r"^venvs:\n\t(.*)$", text, flags=re.M)
    assert "-j2" in venvs and all(s in venvs for s in ("$(STAMP)", "$(COLAB_STAMP)"))
    recipe = re.search(r"^test:\n((?:\t.*\n)+)", text, flags=re.M).group(1)
    lines = [line for line in recipe.replace("\\\n", " ").splitlines()]
    assert "nice -n 19 $(MAKE) --no-print-directory $(OLDEST_STAMP)" in lines[0]
    assert lines[0].rstrip().endswith("&") and "$(OLDEST_LOG).status" in lines[0]
    assert "$(MAKE) --no-print-directory venvs" in lines[1]
    (wait,) = [i for i, line in enumerate(lines) if "while [ ! -f $(OLDEST_LOG).status ]" in line]
    assert "exit 1" in lines[wait] and wait == len(lines) - 2 and "test-oldest" in lines[-1]
    for stamp in ("COLAB_STAMP", "OLDEST_STAMP"):  # neither waits for .venv
        (rule,) = re.findall(rf"^\$\({stamp}\):(.*)$", text, flags=re.M)
        assert "$(STAMP)" not in rule, rule
    installs = {c for c in dry_run(target="test") if " -m pip install " in c and "--upgrade pip" not in c}
    assert len(installs) == 3
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test(\s|$)", ci, flags=re.M) and not re.search(r"make .*-j", ci)
    assert "apt-get install -y -qq chromium" in ci


def test_a_marked_run_collects_only_the_files_that_name_its_marks():
    """`-m "serial or browser"` imports only the test files that name a mark (tests/conftest.py);
    every test those marks select is still collected: a file cannot take them from elsewhere."""
    import conftest as tc

    class Config:
        def __init__(self, expr):
            self.expr = expr

        def getoption(self, name, default=None):
            return self.expr

    serial_file = ROOT / "tests" / "test_lesson03.py"
    plain_file = ROOT / "tests" / "test_env.py"
    assert tc.pytest_ignore_collect(plain_file, Config("serial or browser")) is True
    assert tc.pytest_ignore_collect(serial_file, Config("serial or browser")) is None
    for expr in ("", "not browser and not serial", "slow or not serial"):
        assert tc.pytest_ignore_collect(plain_file, Config(expr)) is None, expr
