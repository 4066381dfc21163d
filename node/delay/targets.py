"""Where a dispatch round's messages go: each to a master of its subject's route. Pure.

A subject served by one real-time group sends all its messages to that group's master (the
common case: one lookup per subject of the batch, no per-message work). A subject spread
over several groups (``cluster/routes.py``) sends each message to the group of its id's
hash, so a dispatch retried after a failure goes to the group that may already hold it and
is de-duplicated there; the delay node's dispatch log records that it went, so lookup by id
needs no map of where (the route and the id say it).

Worked example: a batch with subjects ``("a", "b")``; ``a`` routes to ``rt-1`` at
``10.0.0.1:7002``, ``b`` to ``rt-1, rt-2`` where ``rt-2`` has no master now. Messages of
``a`` all go to ``10.0.0.1:7002``; of ``b``, those whose id hashes to ``rt-1`` go there too
(one request for both subjects) and those hashing to ``rt-2`` are ``stuck``: they stay in
flight and are tried again once ``rt-2`` has a master.
"""

from __future__ import annotations

import numpy as np

from cluster.client import route_of
from cluster.codec import Batch
from cluster.errors import HourglassError
from cluster.routes import RouteView


def split(b: Batch, idx: np.ndarray, views: list[RouteView]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Messages ``idx`` of ``b`` by target address (each part ascending, as ``idx``) and the
    messages whose group has no master now (``stuck``). ``views[k]`` is the route of
    ``b.subjects[k]``."""
    assert len(views) == len(b.subjects), (len(views), len(b.subjects))
    names = sorted({m for v in views for m in v.masters if m})
    code = {m: i for i, m in enumerate(names)}
    per_view = [np.array([code.get(m, -1) for m in v.masters], np.int64) for v in views]
    if all(len(v.groups) == 1 for v in views):  # the hot path: one group per subject
        target = np.array([c[0] for c in per_view], np.int64)[b.subject_idx[idx]]
    else:
        sidx = b.subject_idx[idx]
        target = np.empty(len(idx), np.int64)
        ids = None
        for k in np.unique(sidx).tolist():
            mask = sidx == k
            if len(views[k].groups) == 1:
                target[mask] = per_view[k][0]
                continue
            if ids is None:
                ids = b.id_bytes_list()
            target[mask] = per_view[k][views[k].targets([ids[i] for i in idx[mask].tolist()])]
    out = {names[t]: idx[target == t] for t in np.unique(target).tolist() if t >= 0}
    return out, idx[target < 0]


async def realtime_target(router, subject: str, msg_id: str) -> tuple[str, str]:
    """``(group, master address)`` the route of ``subject`` gives id ``msg_id`` now (the rule
    ``split`` dispatches by); ``("", "")`` when no route is known (Lookup still answers)."""
    try:
        view = await route_of(router, subject)
    except HourglassError:
        return "", ""
    k = int(view.targets([msg_id])[0]) if len(view.groups) > 1 else 0
    return view.groups[k], view.masters[k]
