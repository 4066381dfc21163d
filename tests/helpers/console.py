"""The console's browser tests' harness: a ``hourglass console`` process, a headless
Chromium driven by Selenium, and screenshots into docs/img (docs/console.md shows them, so
they stay current). Everything is stopped by its own PID; every wait is bounded."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "img"
CONSOLE_START_S_MAX = 60.0
WAIT_S_MAX = 30.0


def browser_or_skip():
    """A headless Chromium (Debian's chromium + chromium-driver), or skip saying what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium/chromedriver (scripts/setup.sh installs the Debian packages chromium and "
                    "chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e .[test])")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        opts.add_argument(a)
    opts.accept_insecure_certs = True  # the dev cluster's CA is not the browser's
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(WAIT_S_MAX)
    return d


class ConsoleProcess:
    """``python -m cluster.cli console ARGS --port P`` until ``stop``."""

    def __init__(self, args: list[str], log: Path, *, https: bool = False) -> None:
        self.port = free_port()
        self.url = f"{'https' if https else 'http'}://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for k in [k for k in env if k.startswith(("HOURGLASS_TLS_", "HOURGLASS_TOKEN"))]:
            env.pop(k)
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "console", *args, "--port", str(self.port)],
                                     cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        deadline = time.monotonic() + CONSOLE_START_S_MAX
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"console exited {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"console not up after {CONSOLE_START_S_MAX} s: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def shot(driver, name: str) -> Path:
    """A screenshot of the current page as docs/img/console-NAME.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"console-{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_for(driver, condition, what: str, timeout_s: float = WAIT_S_MAX):
    """Poll ``condition`` until it is true. A page that refreshes itself replaces its elements:
    an element found in one poll and gone by the next call on it (stale) is looked up again
    at the next poll, not an error (the suite's one failure at 2224dea+: the cluster page's
    ``#live`` replaced between ``find`` and ``get_attribute``)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(condition, message=what)
