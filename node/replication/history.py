"""A replicated log's epoch history as a file: which term wrote which offsets, and the
point the group acknowledged (``EpochHistory`` in node/replication/core.py is the rule;
this is its persistence, written atomically beside the data)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from node.replication.core import EpochHistory
from node.store import checkpoint


class HistoryFile:
    """A log's epoch history, persisted atomically beside the data."""

    ACKED_SAVE_INTERVAL_S = 1.0  # the acknowledged point is persisted at most this often (memory has it at once)

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = checkpoint.read(path)
        self.history = EpochHistory([tuple(x) for x in doc["entries"]]) if doc else EpochHistory()
        self.acked = int(doc.get("acked", -1)) if doc else -1
        self._acked_saved_at = 0.0

    def save(self) -> None:
        checkpoint.write_atomic(self.path, {"entries": [list(x) for x in self.history.entries], "acked": self.acked})
        self._acked_saved_at = time.monotonic()

    def note_acked(self, acked: int) -> None:
        self.acked = max(self.acked, acked)
        if time.monotonic() - self._acked_saved_at >= self.ACKED_SAVE_INTERVAL_S:
            self.save()

    def clamp(self, log_end: int) -> None:
        """Entries that start past the log's end (adopted before a crash lost the bytes) go."""
        if self.history.entries and self.history.entries[-1][1] > log_end:
            self.history.entries = [(e, o) for e, o in self.history.entries if o <= log_end]
            self.save()

    def adopt(self, master_history_json: str, log_end: int) -> None:
        before = list(self.history.entries)
        self.history.adopt([tuple(x) for x in json.loads(master_history_json)], log_end)
        if self.history.entries != before:
            self.save()

    def truncate(self, cut: int) -> None:
        self.history.truncate(cut)
        self.save()
