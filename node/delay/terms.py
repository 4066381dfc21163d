"""The delay group's term table: which node took each store epoch (issue 31, the trace's
"accepted (node, time)"; docs/format.md, "Term table"; docs/replication.md, "Terms").

A message's seq carries the store epoch that issued it (``seq >> SEQ_EPOCH_SHIFT``); a store
epoch is taken by exactly one node (the election hands out a new one per term,
``store_epoch_min``; a node that is its group's only member bumps its own at open). The
message record has no node column; this table maps store epoch -> node id, so a lookup names
the node that accepted a message whoever answers it, the old master's records traced after a
failover included.

What it owns: ``terms.json`` in the delay node's data folder (a checkpoint file: one line of
JSON and a CRC line, ``node/store/checkpoint.py``): ``{"version": 1, "terms": [[store epoch,
node id], ...]}``, by epoch, at most ``TERMS_MAX`` (the newest; a message of an older term
traces naming the term only, as data written before this table did).

Rules:

* a master writes its own entry (``take``) once its store epoch is final and before it
  accepts a record (``DelayService``: at open of a group of one, after a promotion), durably
  (the atomic write fsyncs the file and the folder);
* a master ships the whole table with every fetch answer (the ``terms`` key of the fetch
  answer's ``checkpoint`` document); a slave merges it (``adopt``) **before** it appends the
  answer's bytes, so it never holds a record of a term it cannot name; the master's entry wins
  a disagreement (a slave follows the master's log);
* ``node_of(epoch)``: the node id, or ``""`` when the table does not name the epoch.

Pure apart from ``load``/``save`` (``TermTable`` takes a path; ``merged`` is the rule).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cluster.errors import CorruptRecord
from node.store import checkpoint

log = logging.getLogger("hourglass.delay.terms")

FILE_NAME = "terms.json"
TERMS_VERSION = 1
TERMS_MAX = 256  # entries kept (the newest epochs): each is a term, a failover or a restart


def merged(mine: dict[int, str], theirs: dict[int, str], *, keep: int = TERMS_MAX) -> dict[int, str]:
    """``mine`` with ``theirs`` over it (theirs win a disagreement), the newest ``keep`` epochs."""
    out = dict(mine)
    out.update(theirs)
    return dict(sorted(out.items())[-keep:])


def parse(raw) -> dict[int, str]:
    """Epoch -> node id of a ``[[epoch, node id], ...]`` list (what the file and a fetch answer
    carry); entries that are not such pairs are left out."""
    out: dict[int, str] = {}
    if not isinstance(raw, list):
        return out
    for item in raw:
        try:
            epoch, node = item
            if isinstance(node, str) and node and int(epoch) >= 0:
                out[int(epoch)] = node
        except (TypeError, ValueError):
            continue
    return out


class TermTable:
    """The term table of one delay node (module docs)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / FILE_NAME
        self.terms: dict[int, str] = {}
        self._encoded = "[]"
        try:
            doc = checkpoint.read(self.path)
        except (CorruptRecord, ValueError, OSError) as e:
            log.warning("term table unusable path=%s reason=%s: traces name the term only until it is written",
                        self.path, e)
            doc = None
        if doc and doc.get("version") == TERMS_VERSION:
            self.terms = parse(doc.get("terms"))
        self._encode()

    def _encode(self) -> None:
        self._encoded = json.dumps([[e, n] for e, n in sorted(self.terms.items())])

    def _set(self, terms: dict[int, str]) -> bool:
        if terms == self.terms:
            return False
        self.terms = terms
        self._encode()
        checkpoint.write_atomic(self.path, {"version": TERMS_VERSION, "terms": [[e, n] for e, n in sorted(terms.items())]})
        return True

    def take(self, epoch: int, node_id: str) -> bool:
        """This node took store epoch ``epoch`` (a master, before it accepts a record)."""
        return self._set(merged(self.terms, {int(epoch): node_id}))

    def adopt(self, raw) -> bool:
        """A master's table (``[[epoch, node id], ...]``) merged in; True when it changed."""
        theirs = parse(raw)
        return bool(theirs) and self._set(merged(self.terms, theirs))

    def node_of(self, epoch: int) -> str:
        return self.terms.get(int(epoch), "")

    def encoded(self) -> str:
        """The table as the JSON list a fetch answer carries (kept encoded: every answer ships it)."""
        return self._encoded


__all__ = ["FILE_NAME", "TERMS_MAX", "TermTable", "merged", "parse"]
