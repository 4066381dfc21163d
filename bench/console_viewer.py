"""An operator with the web console open, for the benchmarks (issue 31: "the console adds no
load that shows in the sustain benchmark").

``ConsoleViewer`` starts ``hourglass console`` against a cluster's meta servers (open: the
benchmarks' clusters are the open dev kind) and a thread that loads the pages an operator
has open as their browser would: the Cluster page's fragment every ``PAGE_REFRESH_MS`` (its
script does that) and the Schedule page as often (an operator pressing reload). The console
process's PID is reported so its own CPU can be counted apart from the nodes'. Every wait is
bounded; the process is stopped by its PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from cluster.console.app import PAGE_REFRESH_MS
from cluster.ports import free_port

PAGES = ("/cluster?fragment=1", "/schedule")
START_S_MAX = 30.0
STOP_S_MAX = 10.0
FETCH_TIMEOUT_S = 10.0


class ConsoleViewer:
    def __init__(self, meta_addresses: list[str], log_path: Path, *, pages=PAGES,
                 every_s: float = PAGE_REFRESH_MS / 1000) -> None:
        self.meta = ",".join(meta_addresses)
        self.log_path = log_path
        self.pages = tuple(pages)
        self.every_s = every_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.fetched = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "ConsoleViewer":
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "console", "--meta", self.meta,
                                          "--port", str(port)], stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                                         env=os.environ.copy())
        deadline = time.monotonic() + START_S_MAX
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the console exited with {self.proc.returncode} (see {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the console did not answer within {START_S_MAX:g} s (see {self.log_path})")
                time.sleep(0.2)
        self._thread = threading.Thread(target=self._view, name="console-viewer", daemon=True)
        self._thread.start()
        return self

    def _view(self) -> None:
        while not self._stop.is_set():
            for page in self.pages:
                try:
                    with urllib.request.urlopen(self.url + page, timeout=FETCH_TIMEOUT_S) as r:
                        r.read()
                    self.fetched += 1
                except OSError as e:
                    if len(self.errors) < 20:
                        self.errors.append(f"{page}: {e}")
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(FETCH_TIMEOUT_S + 1)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_S_MAX)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_S_MAX)
