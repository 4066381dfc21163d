"""What every Hourglass server process does the same way (nodes and meta servers): an
owner-only umask, log format, the ready file its launcher waits for, and a stack dump of
every task on SIGUSR1."""

from __future__ import annotations

import asyncio
import logging
import os

from cluster.files import DATA_MODE, write_atomic

SERVER_UMASK = 0o077  # files and folders a server makes are its owner's only (docs/security.md)


def restrict_umask() -> int:
    """Set the process umask to ``SERVER_UMASK`` (first thing a server process does): every file
    and folder it or its children create without an explicit mode is owner-only (0600 / 0700).
    Returns the previous umask."""
    return os.umask(SERVER_UMASK)


def write_ready_file(path, address: str) -> None:
    """Atomically write "host:port" once serving (``hourglass dev``/tests wait for it)."""
    if path:
        write_atomic(path, address.encode(), mode=DATA_MODE)


def dump_tasks() -> None:
    """Log the stack of every asyncio task (a stuck node tells where it waits)."""
    for t in asyncio.all_tasks():
        frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in t.get_stack(limit=30)]
        logging.getLogger("hourglass.tasks").warning("task %s:\n  %s", t.get_name(), "\n  ".join(frames))


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
