"""A message's trace: its hops, in order, from what the nodes answer (pure; issue 31).

In: the delay Lookup (``Producer.lookup`` as a dict: ``status``, ``seq``, ``deliver_at_ms``,
``subject``, ``accepted_ms``, ``effective_ms``, ``cancelled_ms``, ``store_epoch``,
``dispatched_ms``, ``dead_lettered``, ``realtime_group``; ``group``: the delay group that
answered and ``node_id`` its member; ``accepted_node_id``: the node that took the store epoch
that accepted it, from the group's term table, node/delay/terms.py; ``""`` for data older than
that table: the hop then names the term only) and, once it was dispatched, the real-time node's
``Consumer/Trace`` under ``"realtime"`` (``node_id``, ``group``, ``position``, ``stored_ms``,
``attempts``, ``groups``: ``[{"group", "state", "copy_id", "copy_subject", "copy_ms"}]``)
or why it could not be asked under ``"realtime_error"``. Out: ``Hop`` s.

Hops, in order: ``accepted``, ``filed``, ``fired``, ``stored at the real-time node``; then,
per consumer group (by name), ``delivered to G`` and ``acked by G`` / ``nacked by G`` (``acked
or nacked by G`` while it waits); then ``dead-lettered``, ``cancelled``. Without the real-time
answer the per-group hops are the two fixed ones ``delivered`` and ``acked or nacked``
(``HOPS``): ``waiting`` before the message fired, else ``unknown`` saying why.

States: ``done`` | ``waiting`` | ``unknown`` (no node could say) | ``skipped`` (cannot happen now).

Example: dispatched, stored on ``realtime-1``; group ``a`` acked, group ``b`` nacked it to the
dead letters as ``m~r1``: accepted, filed, fired, stored, delivered to a, acked by a,
delivered to b, nacked by b, dead-lettered (done: ``m~r1``), cancelled (skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass
class Hop:
    name: str
    state: str                 # done | waiting | unknown | skipped
    detail: str = ""


def iso(ms: int | None) -> str:
    """UTC time of epoch ms as ``2026-11-27T01:02:03Z`` (``-`` for none)."""
    if ms is None or ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# Lookup status -> the hops it proves done. ``in_flight``: fired, not yet confirmed by a
# real-time node; ``dispatched``: a real-time node stored it (the dispatch log says so).
_DONE_BY_STATUS = {
    "pending": ("accepted", "filed"),
    "in_flight": ("accepted", "filed", "fired"),
    "dispatched": ("accepted", "filed", "fired", "stored at the real-time node"),
    "cancelled": ("accepted", "filed", "cancelled"),
}
HOPS = ("accepted", "filed", "fired", "stored at the real-time node", "delivered", "acked or nacked",
        "dead-lettered", "cancelled")
DELIVERY_HOPS = ("delivered", "acked or nacked")


def accepted_by(lookup: dict, group: str, epoch: int) -> str:
    """Who accepted it: ``by delay-1 (node d1, store epoch 3)``; without a node named (data older
    than the term table) ``by delay-1 (store epoch 3)``."""
    node = lookup.get("accepted_node_id") or ""
    inner = ", ".join(([f"node {node}"] if node else []) + ([f"store epoch {epoch}"] if epoch else []))
    return f"by {group}" + (f" ({inner})" if inner else "")


def _delay_hops(lookup: dict, now_ms: int) -> dict[str, Hop]:
    status = lookup.get("status", "")
    done = _DONE_BY_STATUS.get(status, ())
    due = int(lookup.get("deliver_at_ms") or 0)
    group = lookup.get("group") or "a delay group"
    accepted = int(lookup.get("accepted_ms") or 0)
    eff = int(lookup.get("effective_ms") or 0)
    fires = eff or due
    epoch = int(lookup.get("store_epoch") or 0)
    fired_ms = int(lookup.get("dispatched_ms") or 0)
    rt = lookup.get("realtime") or {}
    rt_group = rt.get("group") or lookup.get("realtime_group") or ""
    details = {
        "accepted": accepted_by(lookup, group, epoch) + f", seq {lookup.get('seq', '?')}"
                    + (f", at {iso(accepted)}" if accepted else "")
                    + (f"; answered by {lookup['node_id']}" if lookup.get("node_id") else ""),
        "filed": f"in the schedule, due {iso(due)}" + (f", filed under {iso(eff)}" if eff and eff != due else ""),
        "fired": (f"at {iso(fires)}, its dispatch recorded at {iso(fired_ms)}" if fired_ms else
                  f"at its due time {iso(fires)}" if fires <= now_ms else f"due in {(fires - now_ms) / 1000:.0f} s")
                 + (f" to {rt_group}" if rt_group and status == "dispatched" else ""),
        "stored at the real-time node": f"subject {lookup.get('subject', '?')}",
        "cancelled": f"at {iso(int(lookup.get('cancelled_ms') or 0))}",
    }
    if rt:
        details["stored at the real-time node"] = (
            f"{rt.get('group', '?')}" + (f" ({rt['node_id']})" if rt.get("node_id", "") != rt.get("group") else "")
            + f", subject {lookup.get('subject', '?')} position "
            f"{rt.get('position', '?')}, at {iso(int(rt.get('stored_ms') or 0))}")
    elif lookup.get("dead_lettered"):
        details["stored at the real-time node"] = "as a dead letter (the delay node could not deliver it)"
    out = {}
    for name in ("accepted", "filed", "fired", "stored at the real-time node"):
        if name in done:
            out[name] = Hop(name, "done", details[name])
        elif status == "cancelled":
            out[name] = Hop(name, "skipped", "cancelled before this")
        else:
            out[name] = Hop(name, "waiting", details[name])
    if status == "cancelled":
        out["cancelled"] = Hop("cancelled", "done", details["cancelled"])
    elif status in ("in_flight", "dispatched"):
        out["cancelled"] = Hop("cancelled", "skipped", "too late to cancel")
    else:
        out["cancelled"] = Hop("cancelled", "waiting", "cancellable")
    return out


def _group_hops(groups: list[dict]) -> tuple[list[Hop], list[str]]:
    """Per group (by name) its two hops, and the dead-letter copies found."""
    hops, dead = [], []
    for g in sorted(groups, key=lambda g: g.get("group", "")):
        name, state = g.get("group", "?"), g.get("state", "")
        copy = g.get("copy_id") or ""
        if state == "waiting":
            hops += [Hop(f"delivered to {name}", "waiting", "not handed out yet"),
                     Hop(f"acked or nacked by {name}", "waiting", "")]
            continue
        hops.append(Hop(f"delivered to {name}", "done", ""))
        if state == "in_flight":
            hops.append(Hop(f"acked or nacked by {name}", "waiting", "in flight: handed out, not acked yet"))
        elif state == "acked":
            hops.append(Hop(f"acked by {name}", "done", ""))
        elif state == "nacked":
            hops.append(Hop(f"nacked by {name}", "done", f"retried as {copy}" if copy else ""))
        elif state == "dead_lettered":
            hops.append(Hop(f"nacked by {name}", "done", f"dead-lettered as {copy}"))
            dead.append(f"{copy} in {g.get('copy_subject') or 'hourglass.dlq'}"
                        + (f" at {iso(int(g['copy_ms']))}" if g.get("copy_ms") else "") + f" (nacked by {name})")
        else:
            hops.append(Hop(f"acked or nacked by {name}", "unknown", f"state {state!r}"))
    return hops, dead


def hops(lookup: dict, now_ms: int) -> list[Hop]:
    """The hops of one message, in order (module docstring)."""
    status = lookup.get("status", "")
    d = _delay_hops(lookup, now_ms)
    head = [d[n] for n in ("accepted", "filed", "fired", "stored at the real-time node")]
    rt = lookup.get("realtime")
    if rt is not None and status == "dispatched":
        middle, dead = _group_hops(list(rt.get("groups") or []))
        if not middle:
            middle = [Hop("delivered", "waiting", "no consumer group has pulled this subject on "
                                                  f"{rt.get('group', 'its real-time group')} yet")]
        if dead:
            tail = Hop("dead-lettered", "done", "; ".join(dead))
        elif any(h.state == "waiting" for h in middle):
            tail = Hop("dead-lettered", "waiting", "")
        else:
            tail = Hop("dead-lettered", "skipped", "no group nacked it to the dead letters")
        return head + middle + [tail, d["cancelled"]]
    if status == "cancelled":
        middle = [Hop(n, "skipped", "cancelled before this") for n in DELIVERY_HOPS]
        tail = Hop("dead-lettered", "skipped", "cancelled before this")
    elif status == "dispatched" and lookup.get("dead_lettered"):
        middle = [Hop(n, "skipped", "dead-lettered by the delay node") for n in DELIVERY_HOPS]
        tail = Hop("dead-lettered", "done", "by the delay node, to hourglass.dlq")
    elif status == "dispatched":
        why = lookup.get("realtime_error") or "the real-time node was not asked"
        middle = [Hop(n, "unknown", why) for n in DELIVERY_HOPS]
        tail = Hop("dead-lettered", "unknown", why)
    else:
        middle = [Hop(n, "waiting", "") for n in DELIVERY_HOPS]
        tail = Hop("dead-lettered", "waiting", "")
    return head + middle + [tail, d["cancelled"]]


MARKS = {"done": "[x]", "waiting": "[ ]", "unknown": "[?]", "skipped": "[-]"}


def lines(lookup: dict, now_ms: int) -> list[str]:
    """The trace as text (``hourglass trace``): a head line, then one hop a line with a mark."""
    head = (f"message {lookup.get('id', '?')}  status={lookup.get('status', '?')}  "
            f"subject={lookup.get('subject', '?')}  due={iso(int(lookup.get('deliver_at_ms') or 0))}")
    return [head] + [f"  {MARKS[h.state]} {h.name}" + (f"  {h.detail}" if h.detail else "")
                     for h in hops(lookup, now_ms)]


__all__ = ["HOPS", "Hop", "hops", "iso", "lines"]
