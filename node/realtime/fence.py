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
  (``subject_drained``), which is what lets the meta server finish the drain. A draining
  fence names the consumer groups the drain waits for (``consumers``); one that has no state
  here has every entry unacked (it never pulled here, but consumes the subject elsewhere);
* every master of any group, live or draining, reports its consumer groups of the subjects
  that drain anywhere (``watch``, ``report``); the meta server adds the new ones to the
  subject's draining fences and says so (``merged``: ``offsets["consumers_revision"]``).

A fence stays after the drain finished (``draining`` false): a writer whose cached route is
older than the narrowing is refused for as long as the group is not in the route again
(listing the group again deletes the fence).

A node with meta servers refuses every write until it has its first answer (``loaded``):
after a restart it must not take a message of a subject fenced while it was down.

Example: fences ``{"orders": True}``; a batch of ``orders`` and ``audit`` messages stores the
``audit`` ones and answers the ``orders`` ones ``route moved``. With ``consumers`` ``billing,
audit`` for ``orders`` and 40 entries of it here, acked to the end by ``billing`` only (``audit``
never pulled here), 40 are left and ``orders`` is not drained.
"""

from __future__ import annotations

import logging

import numpy as np

from cluster import status
from cluster.codec import Batch
from cluster.errors import RouteMoved, Unavailable
# the record's offsets entries, re-exported
from cluster.routes import CONSUMERS_REPORT_MAX, CONSUMERS_REVISION_KEY, FENCE_REVISION_KEY  # noqa: F401

log = logging.getLogger("hourglass.fence")

_NONE = np.zeros(0, np.int64)
WAITING_SHOWN_MAX = 20         # consumer groups a drain's progress names


def moved(group: str, subject: str) -> RouteMoved:
    return RouteMoved(f"real-time group {group} no longer takes subject {subject!r} (the route was narrowed; "
                      f"it drains): refresh the route and send to the group it names")


def _rows(count: int | None, groups: dict[str, tuple[int, bool]], required, released) -> dict[str, tuple[int, bool]]:
    """``drain_left``'s consumer groups: those with state here and the required ones (with
    every entry unacked when they have none), less the released ones."""
    n = count or 0
    rows = {g: v for g, v in groups.items() if g not in released}
    for g in required:
        if g not in released:
            rows.setdefault(g, (n, False))
    return rows


def drain_left(count: int | None, groups: dict[str, tuple[int, bool]], required=(), released=()) -> int:
    """Entries of a draining subject a consumer group still needs on this node, summed over
    the consumer groups: ``count`` entries in its index (None: the node never had the
    subject), ``groups`` each consumer group's ``name -> (unacked entries, idle)`` here,
    ``required`` the consumer groups the drain waits for by name (the fence's ``consumers``:
    seen on any of the subject's groups), ``released`` those an operator released from the
    drain (the fence's ``released``: they hold nothing back, whatever they have not acked).
    A required group with no state here has every entry unacked; an idle group (retention
    found it idle past ``group_idle_ms_max``) holds nothing back, as for retention; with no
    consumer group at all, known, required or released, every entry is left (messages nobody
    ever pulled are not given up)."""
    if not groups and not required and not released:
        return count or 0
    return sum(lag for lag, idle in _rows(count, groups, required, released).values() if lag > 0 and not idle)


def subject_drained(count: int | None, groups: dict[str, tuple[int, bool]], required=(), released=()) -> bool:
    """A draining subject holds nothing a consumer group still needs on this node
    (``drain_left`` is 0)."""
    return drain_left(count, groups, required, released) == 0


def waiting_for(count: int | None, groups: dict[str, tuple[int, bool]], required=(), released=()) -> list[str]:
    """The consumer groups a drain waits for on this node (sorted; ``drain_left``'s rule)."""
    if not groups and not required and not released:
        return []
    return sorted(g for g, (lag, idle) in _rows(count, groups, required, released).items() if lag > 0 and not idle)


class NodeFences:
    """The fences a node enforces, as of ``revision`` (an etcd revision, 0 before any), the
    consumer groups each draining one waits for, and the subjects draining anywhere
    (``watch``: a master reports its consumer groups of them, ``report``)."""

    def __init__(self, group: str, *, required: bool) -> None:
        self.group = group
        self.subjects: dict[str, bool] = {}  # subject -> draining (False: finished, still fenced)
        self.consumers: dict[str, tuple[str, ...]] = {}  # draining subject -> consumer groups it waits for
        self.released: dict[str, tuple[str, ...]] = {}  # draining subject -> consumer groups released from it
        self.watch: tuple[str, ...] = ()  # subjects draining in any group (this one's included)
        self.revision = 0
        self.consumers_revision = 0  # the meta server recorded this node's report of the watch list at it
        self.loaded = not required  # a node without meta servers has no fences to wait for

    def load(self, revision: int, fences: list[tuple], watch=()) -> bool:
        """Take the meta server's answer read at ``revision`` (0: a meta server that knows no
        fences: nothing changes): ``fences`` ``(subject, draining[, consumers[, released]])``, ``watch``
        the subjects draining anywhere; an answer older than the one held is ignored. Returns
        whether the fenced set changed."""
        self.loaded = True
        if revision <= 0 or revision < self.revision:
            return False
        new = {f[0]: bool(f[1]) for f in fences}
        consumers = {f[0]: tuple(sorted(f[2])) for f in fences if len(f) > 2 and f[1] and f[2]}
        released = {f[0]: tuple(sorted(f[3])) for f in fences if len(f) > 3 and f[1] and f[3]}
        changed = new != self.subjects
        if changed:
            added = sorted(set(new) - set(self.subjects))
            gone = sorted(set(self.subjects) - set(new))
            log.warning("fences group=%s revision=%d added=%s removed=%s draining=%d", self.group, revision,
                        ",".join(added)[:500] or "-", ",".join(gone)[:500] or "-", sum(new.values()))
        if consumers != self.consumers:
            log.info("drains of group=%s wait for consumer groups %s (revision %d)", self.group,
                     "; ".join(f"{s}: {','.join(g)}" for s, g in sorted(consumers.items()))[:500] or "-", revision)
        if released != self.released:
            log.warning("drains of group=%s released consumer groups %s (revision %d): their unacked messages "
                        "here are given up", self.group,
                        "; ".join(f"{s}: {','.join(g)}" for s, g in sorted(released.items()))[:500] or "-", revision)
        self.subjects, self.consumers, self.released, self.revision = new, consumers, released, revision
        self.watch = tuple(sorted(set(watch)))
        return changed

    def merged(self, revision: int) -> None:
        """The meta server recorded this node's consumer groups of the watch list read at
        ``revision`` in every draining fence (``HeartbeatResponse.consumers_merged``)."""
        self.consumers_revision = max(self.consumers_revision, revision)

    def report(self, store) -> tuple[int, list[tuple[str, list[str]]]]:
        """What a master tells the meta server on its heartbeats: ``(revision of the watch
        list, [(subject, its consumer groups here that are not idle)])`` for every watched
        subject it has groups of; ``(0, [])`` before any answer, or when the report would be
        longer than ``CONSUMERS_REPORT_MAX`` names (then it never counts as complete)."""
        if not self.loaded or not self.revision:
            return 0, []
        out, n = [], 0
        for s in self.watch:
            names = sorted(g for g, (_, idle) in store.unacked(s)[1].items() if not idle)
            if names:
                out.append((s, names))
                n += len(names)
        if n > CONSUMERS_REPORT_MAX:
            log.error("group=%s has %d consumer groups of draining subjects, more than %d: not reported (the "
                      "drains wait)", self.group, n, CONSUMERS_REPORT_MAX)
            return 0, []
        return self.revision, out

    def check_loaded(self) -> None:
        if not self.loaded:
            raise Unavailable(f"real-time group {self.group}: waiting for the meta servers' answer (fences) "
                              f"before taking messages")

    def draining(self) -> list[str]:
        return sorted(s for s, d in self.subjects.items() if d)

    def drained(self, store) -> list[str]:
        """The draining subjects ``store`` (a ``RealtimeStore``: ``unacked``) holds nothing of
        that a consumer group still needs (``subject_drained``, with the fence's consumers)."""
        if not self.loaded:
            return []
        return [s for s in self.draining()
                if subject_drained(*store.unacked(s), self.consumers.get(s, ()), self.released.get(s, ()))]

    def progress(self, store) -> list[dict]:
        """Each draining subject: entries left to acknowledge here (``drain_left``) and the
        consumer groups that hold it back (``hourglass status``, ``hourglass admin route``)."""
        if not self.loaded:
            return []
        out = []
        for s in self.draining():
            count, groups = store.unacked(s)
            required, released = self.consumers.get(s, ()), self.released.get(s, ())
            row = {"subject": s, "left": drain_left(count, groups, required, released),
                   "waiting_for": waiting_for(count, groups, required, released)[:WAITING_SHOWN_MAX]}
            if released:
                row["released"] = list(released)[:WAITING_SHOWN_MAX]
            out.append(row)
        return out

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
