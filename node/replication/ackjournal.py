"""Acknowledgement journal: when a replicated master answered sends OK, for the chaos checker.

Off by default; ``HOURGLASS_ACK_JOURNAL=/path/acks.jsonl`` turns it on. The delay master
calls ``note(epoch, now_ms)`` after each SendBatch it acknowledged (``sync`` or ``async``);
``cluster/chaoscheck.py`` reads every member's lines and fails a run in which two members
of a group acknowledged in overlapping windows (the rule of ``docs/replication.md``: an old
master has stopped acknowledging before a new one can be elected).

File format: JSON lines ``{"node", "group", "epoch", "first_ms", "last_ms"}`` (wall-clock ms,
``time.time``; every process of a chaos run shares one machine and one clock). A window is
one (node, epoch): ``first_ms`` is its first acknowledgement, ``last_ms`` the latest one
written so far. Lines of one window are cumulative, so a reader takes min ``first_ms`` and
max ``last_ms`` per (group, node, epoch). Several nodes may share one file (lines are
appended with one ``write`` each, ``O_APPEND``), or each has its own.

Cost and what a SIGKILL loses: the window lives in memory; a line is written when the epoch
changes (the old window's last state, then the new window's first line) and otherwise at
most every ``WRITE_INTERVAL_MS`` while acknowledging, with no fsync (the page cache survives
a SIGKILL of the process). So the journal may miss the last < ``WRITE_INTERVAL_MS`` of a
window; the checker extends every window by that much (``ACK_WINDOW_PAD_MS``).

Worked example (interval 20 ms)::

    j.note(7, 1000)   # writes {"epoch": 7, "first_ms": 1000, "last_ms": 1000}
    j.note(7, 1010)   # in memory only (10 ms since the last line)
    j.note(7, 1025)   # writes first 1000, last 1025
    j.note(9, 4000)   # epoch changed: nothing new for 7 (1025 written); writes 9: 4000..4000

A write that fails (disk full) is logged once and turns the journal off: it is a test aid and
never fails a send.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from cluster.files import DATA_DIR_MODE, DATA_MODE

log = logging.getLogger("hourglass.ackjournal")

WRITE_INTERVAL_MS = 20


class AckJournal:
    def __init__(self, path: str | os.PathLike | None, *, node: str, group: str,
                 interval_ms: int = WRITE_INTERVAL_MS) -> None:
        self.node = node
        self.group = group
        self.interval_ms = interval_ms
        self._fd: int | None = None
        self._epoch: int | None = None
        self._first_ms = 0
        self._last_ms = 0
        self._written_ms = 0     # last_ms of the last line written for the current window
        self._wrote_at_ms = 0    # when (now_ms) that line was written
        if path is not None:
            p = Path(path)
            p.parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
            self._fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, DATA_MODE)
            self.path = p

    @classmethod
    def from_settings(cls, settings) -> "AckJournal":
        """The journal a node's settings ask for (a no-op one when ``ack_journal`` is unset)."""
        return cls(settings.replication.ack_journal, node=settings.server.node_id, group=settings.server.group)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def note(self, epoch: int, now_ms: int) -> None:
        """An acknowledgement given at ``now_ms`` (wall clock) as master of ``epoch``."""
        if self._fd is None:
            return
        if epoch != self._epoch:
            if self._epoch is not None and self._written_ms != self._last_ms:
                self._write()
            self._epoch, self._first_ms, self._last_ms = epoch, now_ms, now_ms
            self._write()
            self._wrote_at_ms = now_ms
            return
        self._last_ms = max(self._last_ms, now_ms)
        if now_ms - self._wrote_at_ms >= self.interval_ms:
            self._write()
            self._wrote_at_ms = now_ms

    def flush(self) -> None:
        """Write the current window's latest state if a line does not hold it yet."""
        if self._fd is not None and self._epoch is not None and self._written_ms != self._last_ms:
            self._write()

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self) -> None:
        line = json.dumps({"node": self.node, "group": self.group, "epoch": self._epoch,
                           "first_ms": self._first_ms, "last_ms": self._last_ms}, separators=(",", ":")) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as e:
            log.error("ack journal write failed path=%s: %s; journal off", self.path, e)
            os.close(self._fd)
            self._fd = None
            return
        self._written_ms = self._last_ms
