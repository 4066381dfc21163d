"""A real-time node's fences: the subjects its group no longer takes (docs/design.md,
"Narrowing drains first"). Pure: no I/O, no clock.

A narrowing drops a group from a subject's route; the meta server writes, in the same etcd
transaction as the route, a fence ``/hourglass/fences/{group}/{subject}``
(``metaserver/fences.py``). Every member of the group gets its group's fences on each
Register and Heartbeat answer, with the etcd revision they were read at, and:

* refuses a message of a fenced subject (SendBatch, a producer's and a delay node's
  dispatch alike) with ``RouteMoved`` (OVERLOADED, retryable, text "route moved: ..."):
  nothing of it is stored; the writer refreshes the subject's route and sends it to the
  group the route names now. Consumers still pull here (a fence stops writes, not reads);
* reports the revision it enforces (``offsets["fence_revision"]`` of its registration
  record), so the meta server knows the fence is in force on every member before it lets
  the group leave the route;
* while it is master, reports the draining subjects that hold nothing unacknowledged
  (``subject_drained``), which is what lets the meta server finish the drain.

A fence stays after the drain finished (``draining`` false): a writer whose cached route is
older than the narrowing is refused for as long as the group is not in the route again
(listing the group again deletes the fence).

A node with meta servers refuses every write until it has its first answer (``loaded``):
after a restart it must not take a message of a subject fenced while it was down.

Example: fences ``{"orders": True}``; a batch of ``orders`` and ``audit`` messages stores the
``audit`` ones and answers the ``orders`` ones ``route moved``.
"""

from __future__ import annotations

import logging

import numpy as np

from cluster import status
from cluster.codec import Batch
from cluster.errors import RouteMoved, Unavailable
from cluster.routes import FENCE_REVISION_KEY  # noqa: F401 - the record's offsets entry, re-exported

log = logging.getLogger("hourglass.fence")

_NONE = np.zeros(0, np.int64)


def moved(group: str, subject: str) -> RouteMoved:
    return RouteMoved(f"real-time group {group} no longer takes subject {subject!r} (the route was narrowed; "
                      f"it drains): refresh the route and send to the group it names")


def subject_drained(count: int | None, groups: list[tuple[int, bool]]) -> bool:
    """A draining subject holds nothing a consumer group still needs on this node: ``count``
    entries in its index (None: the node never had the subject), ``groups`` each consumer
    group's ``(unacked entries, idle)``. Every group acked everything (an idle group, one
    retention found idle past ``group_idle_ms_max``, holds nothing back, as for retention);
    with no consumer group at all, only an empty subject is drained (messages nobody ever
    pulled here are not given up)."""
    if not groups:
        return not count
    return all(lag <= 0 or idle for lag, idle in groups)


class NodeFences:
    """The fences a node enforces, as of ``revision`` (an etcd revision, 0 before any)."""

    def __init__(self, group: str, *, required: bool) -> None:
        self.group = group
        self.subjects: dict[str, bool] = {}  # subject -> draining (False: finished, still fenced)
        self.revision = 0
        self.loaded = not required  # a node without meta servers has no fences to wait for

    def load(self, revision: int, fences: list[tuple[str, bool]]) -> bool:
        """Take the meta server's answer read at ``revision`` (0: a meta server that knows no
        fences: nothing changes); an answer older than the one held is ignored. Returns
        whether the set changed."""
        self.loaded = True
        if revision <= 0 or revision < self.revision:
            return False
        new = dict(fences)
        changed = new != self.subjects
        if changed:
            added = sorted(set(new) - set(self.subjects))
            gone = sorted(set(self.subjects) - set(new))
            log.warning("fences group=%s revision=%d added=%s removed=%s draining=%d", self.group, revision,
                        ",".join(added)[:500] or "-", ",".join(gone)[:500] or "-", sum(new.values()))
        self.subjects, self.revision = new, revision
        return changed

    def check_loaded(self) -> None:
        if not self.loaded:
            raise Unavailable(f"real-time group {self.group}: waiting for the meta servers' answer (fences) "
                              f"before taking messages")

    def draining(self) -> list[str]:
        return sorted(s for s, d in self.subjects.items() if d)

    def drained(self, store) -> list[str]:
        """The draining subjects ``store`` (a ``RealtimeStore``: ``unacked``) holds nothing of
        that a consumer group still needs (``subject_drained``)."""
        if not self.loaded:
            return []
        return [s for s in self.draining() if subject_drained(*store.unacked(s))]

    def fenced(self, batch: Batch) -> np.ndarray:
        """Indexes (ascending) of the batch's messages of fenced subjects."""
        if not self.subjects:
            return _NONE
        ks = [k for k, s in enumerate(batch.subjects) if s in self.subjects]
        if not ks:
            return _NONE
        return np.flatnonzero(np.isin(batch.subject_idx, ks))

    def refuse(self, res, batch: Batch, idx: np.ndarray) -> int:
        """Answer the messages ``idx`` of ``batch`` in ``res`` (a ``BatchResult``) with
        ``RouteMoved``; returns how many."""
        texts: dict[int, tuple[int, str]] = {}
        for i in idx.tolist():
            k = int(batch.subject_idx[i])
            if k not in texts:
                err = moved(self.group, batch.subjects[k])
                texts[k] = (status.to_code(err), str(err))
            res.refuse(i, *texts[k])
        return len(idx)
