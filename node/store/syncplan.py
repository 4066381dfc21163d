"""Durability work planned on the event loop, done on a worker thread.

A store's periodic flush (fsyncs, headers that vouch for what was fsynced, the
checkpoint document) takes milliseconds of disk time; done on the event loop it stalls
every message due meanwhile. So a store *plans* the flush on the loop, where its state
is consistent: it captures what to vouch for (header bytes, the checkpoint document)
and duplicates the file descriptors involved (a descriptor the loop closes or rolls
meanwhile stays valid for the plan). ``SyncPlan.run`` then does the steps in order on
any thread, and the store is told afterwards (``done`` callbacks, run on the loop by
the caller) which state is now durable.

Why it is safe to write while a plan runs: fsync covers every byte written before it,
so bytes the loop appends during the plan are simply covered by this or the next
flush; the headers and documents a plan writes were captured *before* its fsyncs, so
they never vouch for more than the fsyncs cover.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.store import checkpoint

_FSYNC, _PWRITE, _DOC, _FSYNC_DIR = 0, 1, 2, 3


class DocGate:
    """Orders one store's checkpoint-document writes across threads: a document planned
    earlier never replaces one planned later, and once the store is closed a plan still
    running writes no document (a reopened store, say with a new epoch, has its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self._planned = 0
        self._written = 0

    def ticket(self) -> int:
        self._planned += 1
        return self._planned

    def write(self, ticket: int, path: Path, doc: dict[str, Any]) -> bool:
        with self.lock:
            if self.closed or ticket < self._written:
                return False
            checkpoint.write_atomic(path, doc)
            self._written = ticket
            return True

    def close(self) -> None:
        with self.lock:
            self.closed = True


class SyncPlan:
    """An ordered list of durability steps over duplicated descriptors."""

    def __init__(self) -> None:
        self._steps: list[tuple] = []
        self._fds: list[int] = []
        self._done: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def _dup(self, fd: int) -> int:
        d = os.dup(fd)
        self._fds.append(d)
        return d

    def fsync(self, fd: int) -> None:
        self._steps.append((_FSYNC, self._dup(fd)))

    def fsync_dir(self, path: str | os.PathLike) -> None:
        """fsync a folder, opened and closed by ``run`` (a plan over many new folders, one per
        new subject, opens none of them on the loop)."""
        self._steps.append((_FSYNC_DIR, path))

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        self._steps.append((_PWRITE, self._dup(fd), bytes(data), offset))

    def write_doc(self, gate: DocGate, path: str | os.PathLike, doc: dict[str, Any]) -> None:
        """A checkpoint document, written atomically (``checkpoint.write_atomic``) through
        the store's ``gate`` (see ``DocGate``)."""
        self._steps.append((_DOC, gate, gate.ticket(), Path(path), doc))

    def on_done(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (by ``finish``, on the store's thread) once every step succeeded."""
        self._done.append(fn)

    def run(self) -> None:
        """Do the steps in order; any thread. Closes the duplicated descriptors."""
        try:
            for step in self._steps:
                kind = step[0]
                if kind == _FSYNC:
                    os.fsync(step[1])
                elif kind == _FSYNC_DIR:
                    fd = os.open(step[1], os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                elif kind == _PWRITE:
                    _, fd, data, offset = step
                    view = memoryview(data)
                    while view:
                        n = os.pwrite(fd, view, offset)
                        view, offset = view[n:], offset + n
                else:
                    _, gate, ticket, path, doc = step
                    gate.write(ticket, path, doc)
        finally:
            self.close()

    def finish(self) -> None:
        """After a successful ``run``: tell the store what is now durable."""
        for fn in self._done:
            fn()

    def run_and_finish(self) -> None:
        self.run()
        self.finish()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
