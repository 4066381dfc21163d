"""What a real-time node's ``Admin/Status`` says about its consumer groups (issue 31, the
console's Subjects page): one row per ``(subject, group)``, from the group positions and
in-flight handles the store keeps anyway (``node/realtime/groups.py``); no index or message
is read.

* ``backlog``: entries of the subject never handed out to the group (``count - next``);
* ``lag_messages``: entries the group has not acked (backlog plus in flight; the gauge
  ``hourglass_consumer_lag_messages`` and ``RealtimeStore.lag``);
* ``in_flight``: handed out, not acked yet;
* ``redelivered``: handles handed out again after their ack timeout, since this node opened
  the group (in memory: it starts at 0 after a restart or a promotion);
* ``idle``: retention found the group idle past ``group_idle_ms_max`` (it holds nothing back).

After a restart the positions and in-flight runs are what recovery read back from the
offsets log (in-flight handles come back due at once), so the rows are right from the first
Status; a slave applies the master's group documents and reports them (its own view, as of
its last replicated commit). At most ``rows_max`` rows (the ones lagging most first), and
how many were left out.

Example: subject ``orders`` holds entries 0..99; group ``billing`` was handed out 0..89 and
acked all but 80..89: backlog 10, in flight 10, lag 20.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def group_rows(groups: Iterable, counts: Mapping[str, int], *, rows_max: int) -> tuple[list[dict], int]:
    """``(rows, left_out)``: ``groups`` are ``Group`` objects, ``counts`` subject -> entries
    in its index (the position after its last entry)."""
    rows = []
    for g in groups:
        count = counts.get(g.subject)
        if count is None:
            continue
        backlog = max(0, count - g.next_pos)
        in_flight = len(g.inflight)
        rows.append({"subject": g.subject, "group": g.name, "backlog": backlog, "lag_messages": backlog + in_flight,
                     "in_flight": in_flight, "redelivered": g.redelivered, "idle": bool(g.idle)})
    rows.sort(key=lambda r: (-r["lag_messages"], r["subject"], r["group"]))
    return rows[:rows_max], max(0, len(rows) - rows_max)


__all__ = ["group_rows"]
