"""The repository's conftest.py starts nbval's kernel again when a start fails."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("amp_lessons_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Channels:
    def __init__(self, log):
        self.log = log

    def stop_channels(self):
        self.log.append("stop_channels")


class _Manager:
    def __init__(self, log):
        self.log = log

    def shutdown_kernel(self, now=False):
        self.log.append(f"shutdown now={now}")


def _flaky_base(failures, log, iopub=False):
    """A RunningKernel stand-in whose first ``failures`` starts raise as nbval's do."""
    class Base:
        starts = 0

        def __init__(self, kernel_name, cwd=None, startup_timeout=60):
            type(self).starts += 1
            if iopub:  # the kernel started, then IOPub never came up: the kernel is left running
                self.km, self.kc = _Manager(log), _Channels(log)
            if type(self).starts <= failures:
                raise RuntimeError("Kernel didn't respond in 60 seconds")
            self.started_with = (kernel_name, cwd, startup_timeout)
    return Base


def test_a_failed_start_is_tried_again_with_the_same_arguments(capsys):
    log = []
    kernel_class = _root_conftest()._retrying_kernel(_flaky_base(2, log))
    kernel = kernel_class("python3", cwd="/nb", startup_timeout=120)
    assert kernel.started_with == ("python3", "/nb", 120)
    assert type(kernel).starts == 3
    assert capsys.readouterr().err.count("starting a fresh kernel") == 2


def test_a_kernel_left_running_by_a_failed_start_is_shut_down_before_the_next():
    log = []
    kernel_class = _root_conftest()._retrying_kernel(_flaky_base(1, log, iopub=True))
    kernel_class("python3")
    assert log == ["stop_channels", "shutdown now=True"]


def test_three_failed_starts_raise_one_error_that_says_so():
    kernel_class = _root_conftest()._retrying_kernel(_flaky_base(5, []))
    with pytest.raises(RuntimeError, match=r"did not start in 3 tries; the last: Kernel didn't respond"):
        kernel_class("python3")


def test_nbval_uses_the_retrying_kernel_in_this_session():
    nbval_plugin = pytest.importorskip("nbval.plugin")
    assert getattr(nbval_plugin.RunningKernel, "_amp_lessons_retries", False)
