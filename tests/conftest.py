import pytest
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def chromium():
    """Path of a Chromium executable for the browser tests; skips them where there is none."""
    from browser_helpers import chromium_executable

    path = chromium_executable()
    if path is None:
        pytest.skip("no Chromium executable (install Debian's: apt-get install -y chromium)")
    return path
