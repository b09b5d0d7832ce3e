"""What the browser tests need around Playwright: a Chromium to drive, and a JupyterLab server
that the test starts itself on loopback with a random port and token, in isolated config folders.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parent.parent
OUTPUT_DIR = REPO / "test-output"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# JupyterLab settings for a quiet, fully rendered notebook: no news or update toasts, and every
# cell in the DOM (JupyterLab 4 virtualises cells out of view by default).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        '{"fetchNews": "false", "checkForUpdates": false}',
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
}


def chromium_executable() -> Optional[str]:
    """Debian's Chromium (``/usr/bin/chromium``), else a ``chromium`` on PATH, else None."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLabServer:
    """``python -m jupyter lab`` on 127.0.0.1:<random port> with a random token, serving
    ``root_dir``; config, settings, workspaces and runtime files live under ``state_dir`` so the
    user's own JupyterLab state neither leaks in nor gets changed. Use as a context manager."""

    def __init__(self, root_dir: Path, state_dir: Path, env: Optional[Dict[str, str]] = None,
                 python: str = sys.executable, startup_timeout: float = 60.0):
        self.root_dir, self.state_dir = Path(root_dir), Path(state_dir)
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.python, self.startup_timeout = python, startup_timeout
        self.extra_env = dict(env or {})
        self.log_path = self.state_dir / "jupyter.log"
        self.process: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """``path`` on the server, with the token."""
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    def _environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        folders = {"JUPYTER_CONFIG_DIR": "config", "JUPYTERLAB_SETTINGS_DIR": "settings",
                   "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "JUPYTER_RUNTIME_DIR": "runtime",
                   "IPYTHONDIR": "ipython"}
        for var, name in folders.items():
            path = self.state_dir / name
            path.mkdir(parents=True, exist_ok=True)
            env[var] = str(path)
        for rel, text in LAB_SETTINGS.items():
            target = self.state_dir / "settings" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        env.update(self.extra_env)
        return env

    def start(self) -> "JupyterLabServer":
        cmd = [self.python, "-m", "jupyter", "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root_dir}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers often run as root
            cmd.append("--allow-root")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env=self._environment(), cwd=self.root_dir)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n"
                                   f"{self.log()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"JupyterLab did not answer within {self.startup_timeout:.0f} s:\n"
                           f"{self.log()}")

    def log(self) -> str:
        """The server's output so far (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Shut the server (and its kernels) down; kill it if it does not stop in 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            urllib.request.urlopen(urllib.request.Request(self.url("api/shutdown"), method="POST"),
                                   timeout=5)
        except OSError:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def __enter__(self) -> "JupyterLabServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- what every browser test does first ----------------------------------------------------------

# The status bar reads "Python 3 (ipykernel) | Idle" once the kernel is up.
KERNEL_IDLE = "() => /\\|\\s*Idle/.test(document.body.innerText)"
ALL_CELLS_RAN = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map(e => e.textContent.trim());
    return prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t));
}"""


def lab_serving(tmp_path_factory, notebooks) -> JupyterLabServer:
    """A quick-profile JupyterLab server over copies of ``notebooks`` (paths), in a temp folder."""
    root = tmp_path_factory.mktemp("notebooks")
    for nb in notebooks:
        shutil.copy(nb, root / Path(nb).name)
    return JupyterLabServer(root, tmp_path_factory.mktemp("jupyter"),
                            env={"AMP_LESSONS_PROFILE": "quick"})


def open_and_run_all(page, lab: JupyterLabServer, notebook: str, kernel_timeout_ms: int = 120_000,
                     run_timeout_ms: int = 150_000) -> list:
    """Open ``notebook`` in JupyterLab, wait for its kernel, Run All Cells, wait until every
    code cell has run, and return the texts of the stderr outputs. On a time-out, saves a
    screenshot to test-output/ and fails with the server's log."""
    import re

    page.goto(lab.url(f"lab/tree/{notebook}"))
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    # the kernel must be up before Run All, or JupyterLab asks which kernel to use
    page.locator(".jp-Notebook").first.click()
    page.wait_for_function(KERNEL_IDLE, timeout=kernel_timeout_ms)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    try:
        page.wait_for_function(ALL_CELLS_RAN, timeout=run_timeout_ms)
    except Exception:
        OUTPUT_DIR.mkdir(exist_ok=True)
        page.screenshot(path=str(OUTPUT_DIR / f"{Path(notebook).stem}_run_all_failed.png"),
                        full_page=True)
        raise AssertionError(f"not every cell of {notebook} ran; server log:\n{lab.log()}")
    return page.locator(".jp-OutputArea-output[data-mime-type="
                        "'application/vnd.jupyter.stderr']").all_inner_texts()


@contextmanager
def chromium_page(executable: str, width: int = 1280, height: int = 1000):
    """A page of headless Chromium (``CHROMIUM_ARGS``) with a ``width`` x ``height`` viewport;
    the browser is closed afterwards. Makes ``OUTPUT_DIR`` for screenshots."""
    from playwright.sync_api import sync_playwright

    OUTPUT_DIR.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
