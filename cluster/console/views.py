"""Page models of the console: pure functions from what the cluster answered (Status
documents, a Lookup, per-bucket pending counts) and ``now_ms`` to what a page shows. No
I/O, no clock: the tests drive them with plain dicts.

Worked example (``schedule_rows``): a delay group reports ``{"pending_by_bucket":
{"1700000400000": 5}}`` with 60 s buckets, and now is 1700000000000. The "next 60 minutes by
minute" view has 60 slots of 60 s from the minute of now; the bucket starts 400 s later,
in slot 6 (the slot starting 1700000360000): that row says 5. A group whose buckets are
1 h long cannot be split by minute from its bucket counts; it also reports
``pending_by_minute`` (per-minute counts of the buckets of the next hour, from its per-second
schedule index), and the minute view uses those. A group without them makes the view's slots
1 h instead, and says so (``ScheduleView.resolution_ms``): a count it does not have is never
spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster import trace as _trace
from cluster.trace import iso  # the pages write times as the trace does

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
DAY_MS = 86_400_000

# (name, slot length, slots): the three views of the schedule page (issue 31)
SCHEDULE_VIEWS: tuple[tuple[str, int, int], ...] = (
    ("next 60 minutes, by minute", MINUTE_MS, 60),
    ("next 48 hours, by hour", HOUR_MS, 48),
    ("next 2 years, by day", DAY_MS, 731),
)
ROWS_SHOWN_MAX = 800  # rows of one schedule view (2 years by day is 731)


# ---------------------------------------------------------------------- cluster page


@dataclass
class Member:
    node_id: str
    address: str
    role: str
    group: str
    mode: str                 # master | slave | unreachable
    epoch: str
    lag: str                  # replication lag of a slave; "" on a master
    pending: str
    in_flight: str
    dispatch_lag_ms: str
    disk: str                 # used / free, or "not reported"
    master_changes: str       # in the last hour, or "not reported"
    health: str               # ok | a short reason
    healthy: bool


@dataclass
class Group:
    role: str
    group: str
    members: list[Member] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return any(m.mode == "master" and m.healthy for m in self.members) and all(m.healthy for m in self.members)


def _mib(n) -> str:
    return f"{n / (1 << 20):.1f} MiB" if isinstance(n, (int, float)) else "?"


def member(row: dict) -> Member:
    """One Status row (``hourglass status --json``'s) as a table row."""
    err = row.get("error")
    mode = "unreachable" if err else row.get("mode", "master")
    lag = ""
    if mode == "slave":
        lag = f"{row.get('replication_lag_bytes', 0)} B / {row.get('replication_lag_ms', 0)} ms"
    disk = "not reported"
    if isinstance(row.get("disk"), dict):  # node-side support still needed (docs/console.md)
        d = row["disk"]
        used = "measuring" if d.get("used_bytes") is None else f"{_mib(d.get('used_bytes'))} used"
        disk = f"{used} / {_mib(d.get('free_bytes'))} free"
    changes = row.get("master_changes_1h")
    health, healthy = "ok", True
    if err:
        health, healthy = err, False
    else:
        unrepaired = (row.get("scrub") or {}).get("unrepaired") or {}
        lost = (row.get("healing") or {}).get("lost_records", 0)
        if unrepaired:
            health, healthy = f"{len(unrepaired)} unrepaired segment(s)", False
        elif lost:
            health, healthy = f"{lost} lost record(s)", False
        elif row.get("disk_low"):
            health, healthy = "disk low: writes refused", False
    dispatching = row.get("role") == "delay" and mode == "master"  # a slave fires nothing: its figures mean nothing
    return Member(node_id=str(row.get("node_id", "?")), address=str(row.get("address", "?")),
                  role=str(row.get("role", "?")), group=str(row.get("group", "")), mode=mode,
                  epoch=str(row.get("election_epoch", row.get("epoch", ""))), lag=lag,
                  pending=str(row.get("pending", "")) if dispatching else "",
                  in_flight=str(row.get("in_flight", "")) if dispatching else "",
                  dispatch_lag_ms=str(row.get("dispatch_lag_ms", "")) if dispatching else "",
                  disk=disk, master_changes=str(changes) if changes is not None else "not reported",
                  health=health, healthy=healthy)


def cluster_groups(rows: list[dict], history: "EpochHistory | None" = None, now_ms: int = 0) -> list[Group]:
    """Status rows grouped by (role, group), delay groups first, masters first in a group.
    With ``history``: each group's newest election epoch is recorded there, and a member that
    does not report its master changes itself shows the group's count from the history."""
    groups: dict[tuple[str, str], Group] = {}
    for r in rows:
        m = member(r)
        groups.setdefault((m.role, m.group), Group(m.role, m.group)).members.append(m)
    order = {"master": 0, "slave": 1, "unreachable": 2}
    for (role, name), g in groups.items():
        g.members.sort(key=lambda m: (order.get(m.mode, 3), m.node_id))
        if history is not None:
            epochs = [int(m.epoch) for m in g.members if m.epoch.isdigit() and m.mode != "unreachable"]
            key = f"{role}/{name}"
            if epochs:
                history.record(key, max(epochs), now_ms)
            text = master_changes_text(history.changes(key, now_ms), now_ms, history.window_ms)
            for m in g.members:
                if m.master_changes == "not reported":
                    m.master_changes = text
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0] != "delay", k))]


# ---------------------------------------------------------------------- schedule page


@dataclass
class ScheduleRow:
    start_ms: int
    label: str
    counts: dict[str, int]     # delay group -> pending messages due in this slot
    total: int


@dataclass
class ScheduleView:
    name: str
    slot_ms: int               # the slot length asked for
    resolution_ms: int         # the slot length shown: the coarsest bucket of the groups if longer
    rows: list[ScheduleRow]
    max_total: int             # the longest bar (scales the chart)


def pending_buckets(row: dict) -> tuple[dict[int, int], int] | None:
    """A delay master's pending counts by bucket start (ms) and its bucket length, or None when
    its Status carries none (node-side support, docs/console.md)."""
    raw = row.get("pending_by_bucket")
    if not isinstance(raw, dict):
        return None
    try:
        counts = {int(k): int(v) for k, v in raw.items() if int(v) > 0}
        bucket_ms = int(row.get("bucket_ms", HOUR_MS))
    except (TypeError, ValueError):
        return None
    return counts, max(1, bucket_ms)


def pending_minutes(row: dict) -> dict[int, int] | None:
    """A delay master's pending counts by minute start (ms) for the buckets of the next hour
    (``pending_by_minute``), or None when its Status carries none."""
    raw = row.get("pending_by_minute")
    if not isinstance(raw, dict):
        return None
    try:
        return {int(k): int(v) for k, v in raw.items() if int(v) > 0}
    except (TypeError, ValueError):
        return None


OTHER_SUBJECTS = "(other)"  # what a delay Status sums the subjects past its limit under


def subject_totals(rows: list[dict]) -> tuple[dict[str, int], int]:
    """The subjects the delay masters name in ``pending_subjects`` with their pending counts
    summed over the groups, most first, and what they sum under ``(other)`` (the subject
    selector of the Schedule page)."""
    out: dict[str, int] = {}
    other = 0
    for r in rows:
        raw = r.get("pending_subjects")
        if not isinstance(raw, dict):
            continue
        for k, v in raw.items():
            try:
                n = int(v)
            except (TypeError, ValueError):
                continue
            if k == OTHER_SUBJECTS:
                other += n
            elif n > 0:
                out[str(k)] = out.get(str(k), 0) + n
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))), other


def _of_subject(row: dict, key: str, subject: str) -> dict[int, int] | None:
    """``row[key][subject]`` as start (ms) -> positive count, or None when the row has none."""
    raw = row.get(key)
    if not isinstance(raw, dict) or not isinstance(raw.get(subject), dict):
        return None
    try:
        return {int(k): int(v) for k, v in raw[subject].items() if int(v) > 0}
    except (TypeError, ValueError):
        return None


def subject_buckets(row: dict, subject: str) -> dict[int, int] | None:
    """A delay master's pending counts of ``subject`` by bucket start (``pending_by_subject``,
    answered when the Status asked for that subject), or None when its Status carries none."""
    return _of_subject(row, "pending_by_subject", subject)


def subject_minutes(row: dict, subject: str) -> dict[int, int] | None:
    """A delay master's pending counts of ``subject`` by minute start for the buckets of the
    minute view (``pending_by_subject_minute``, answered with ``pending_by_subject``), or None
    when its Status carries none (a node from before per-subject minutes: its buckets are shown)."""
    return _of_subject(row, "pending_by_subject_minute", subject)


def finer(by_group: dict[str, tuple[dict[int, int], int]], minutes: dict[str, dict[int, int]],
          slot_ms: int) -> dict[str, tuple[dict[int, int], int]]:
    """The counts a view of ``slot_ms`` slots uses: a group whose buckets are longer than a
    slot and that reports counts by minute gives those, with the buckets its minutes do not
    cover (they start later: beyond the hour the minutes cover) at their start."""
    out = {}
    for g, (counts, bucket_ms) in by_group.items():
        m = minutes.get(g)
        if m is None or bucket_ms <= slot_ms or slot_ms < MINUTE_MS:
            out[g] = (counts, bucket_ms)
            continue
        covered = {start - start % bucket_ms for start in m}
        merged = dict(m)
        for start, n in counts.items():
            if start not in covered:
                merged[start] = merged.get(start, 0) + n
        out[g] = (merged, MINUTE_MS)
    return out


def schedule_view(name: str, slot_ms: int, slots: int, by_group: dict[str, tuple[dict[int, int], int]],
                  now_ms: int) -> ScheduleView:
    """Pending counts of each delay group summed into ``slots`` slots of ``slot_ms`` from
    the slot of ``now_ms`` (or of the coarsest bucket length, if longer). Buckets already
    due (before the first slot) count in the first slot: they fire now."""
    res = max([slot_ms] + [b for _, b in by_group.values()])
    first = now_ms - now_ms % res
    n = max(1, min(ROWS_SHOWN_MAX, -(-slots * slot_ms // res)))
    rows = [ScheduleRow(first + i * res, iso(first + i * res), {}, 0) for i in range(n)]
    for group, (counts, _) in by_group.items():
        for start, count in counts.items():
            i = max(0, (start - first) // res)
            if i < n:
                r = rows[i]
                r.counts[group] = r.counts.get(group, 0) + count
                r.total += count
    return ScheduleView(name, slot_ms, res, rows, max([r.total for r in rows] + [1]))


def schedule_views(by_group: dict[str, tuple[dict[int, int], int]], now_ms: int,
                   minutes: dict[str, dict[int, int]] | None = None) -> list[ScheduleView]:
    """The three views; ``minutes``: the groups' ``pending_by_minute`` (``finer``)."""
    return [schedule_view(name, slot, n, finer(by_group, minutes or {}, slot), now_ms)
            for name, slot, n in SCHEDULE_VIEWS]


def lateness_text(row: dict) -> str:
    """A delay master's lateness over its window: ``p50 3 ms, p99 41 ms (1234 fired in the last
    60 min)``, or why there is none."""
    late = row.get("lateness")
    if not isinstance(late, dict):
        return "not reported"
    n = int(late.get("count") or 0)
    minutes = int(late.get("window_ms") or HOUR_MS) // MINUTE_MS
    if not n or late.get("p50_ms") is None:
        return f"nothing fired in the last {minutes} min"
    return f"p50 {late['p50_ms']} ms, p99 {late['p99_ms']} ms ({n} fired in the last {minutes} min)"


# ---------------------------------------------------------------------- message page


# the hops themselves are cluster/trace.py (the SDK's ``Producer.trace`` and the CLI use them too)
Hop, HOPS = _trace.Hop, _trace.HOPS


def trace(lookup: dict, now_ms: int) -> list[Hop]:
    """The hops of one message, in order (``cluster.trace.hops``): a Lookup as a dict, with the
    real-time node's answer under ``"realtime"`` once it was dispatched."""
    return _trace.hops(lookup, now_ms)


def cancellable(lookup: dict) -> bool:
    """Only a pending message may be cancelled (in flight or dispatched: TooLate)."""
    return lookup.get("status") == "pending"


def trace_lines(lookup: dict, now_ms: int) -> list[str]:
    """The trace as text (``hourglass trace``): one hop a line, a mark for its state."""
    return _trace.lines(lookup, now_ms)


# ---------------------------------------------------------------------- subjects page


@dataclass
class NodeFlow:
    node_id: str
    group: str
    subjects: list[str]
    in_per_s: str              # messages stored per second since the previous sample ("-": no sample yet)
    out_per_s: str             # messages handed to consumers per second
    acked_per_s: str
    delivered: int             # totals since the node started
    redelivered: int
    acked: int


@dataclass
class ConsumerRow:
    realtime_group: str        # the real-time group whose master reported it
    subject: str
    group: str                 # the consumer group
    backlog: int               # never handed out
    lag_messages: int          # not acked (backlog + in flight)
    in_flight: int
    redelivered: int           # handed out again since the node opened the group
    idle: bool


def consumer_rows(row: dict) -> list[ConsumerRow] | None:
    """A real-time master's consumer groups (its Status ``groups``), or None when it reports none."""
    raw = row.get("groups")
    if not isinstance(raw, list):
        return None
    out = []
    for g in raw:
        try:
            out.append(ConsumerRow(str(row.get("group", "")), str(g["subject"]), str(g["group"]), int(g["backlog"]),
                                   int(g["lag_messages"]), int(g["in_flight"]), int(g.get("redelivered", 0)),
                                   bool(g.get("idle", False))))
        except (KeyError, TypeError, ValueError):
            continue
    return out


FLOW_COUNTERS = (("in_per_s", "appended"), ("out_per_s", "delivered"), ("acked_per_s", "acked"))


def node_flow(row: dict, prev: tuple[int, dict] | None) -> NodeFlow:
    """A real-time master's flow: its subjects, its counters, and rates from the previous
    sample ``(now_ms, counters)`` of the same node (none on a first look)."""
    counters = row.get("counters") or {}
    now = int(row.get("now_ms") or 0)
    rates = {}
    for name, key in FLOW_COUNTERS:
        if prev is None or now <= prev[0]:
            rates[name] = "-"
        else:
            rates[name] = f"{max(0, counters.get(key, 0) - prev[1].get(key, 0)) * 1000 / (now - prev[0]):.1f}"
    return NodeFlow(node_id=str(row.get("node_id", "?")), group=str(row.get("group", "")),
                    subjects=sorted(str(s) for s in row.get("subjects") or []), **rates,
                    delivered=int(counters.get("delivered", 0)), redelivered=int(counters.get("redelivered", 0)),
                    acked=int(counters.get("acked", 0)))


# ---------------------------------------------------------------------- master changes


class EpochHistory:
    """The election epochs the console has seen per group, to say how many master changes
    the last hour held: every election gives a group a new epoch, so the epoch now minus the
    epoch an hour ago counts the changes between, whatever the console missed in between.
    Until the console has watched a group for an hour, the count is since its first look,
    and says so. Pure: time comes in as ``now_ms``.

    Bounded: one sample per ``sample_ms`` per group, samples older than the window dropped
    (but the newest of them, the window's left edge), at most ``tracked_max`` groups.

    Example: seen epoch 3 at 10:00, 4 at 10:40, 6 at 11:05. At 11:10 the window starts at
    10:10; the newest sample at or before it is 10:00 (epoch 3): 6 - 3 = 3 changes, shown as
    the last hour's. The count may include changes between that sample and the window's start
    (10:00-10:10 here): it is exact when the console looked at the group at least once per
    ``sample_ms`` around then, an upper bound otherwise.
    """

    def __init__(self, *, window_ms: int = HOUR_MS, sample_ms: int = 10_000, tracked_max: int = 1000) -> None:
        assert window_ms > 0 and sample_ms > 0 and tracked_max > 0
        self.window_ms, self.sample_ms, self.tracked_max = window_ms, sample_ms, tracked_max
        self._samples: dict[str, list[tuple[int, int]]] = {}

    def record(self, group: str, epoch: int, now_ms: int) -> None:
        samples = self._samples.get(group)
        if samples is None:
            if len(self._samples) >= self.tracked_max:
                self._samples.pop(next(iter(self._samples)))
            samples = self._samples[group] = []
        if samples and now_ms - samples[-1][0] < self.sample_ms:
            samples[-1] = (samples[-1][0], max(samples[-1][1], epoch))
        else:
            samples.append((now_ms, epoch))
        edge = now_ms - self.window_ms
        while len(samples) > 1 and samples[1][0] <= edge:  # keep one sample at or before the edge
            samples.pop(0)

    def changes(self, group: str, now_ms: int) -> tuple[int, int] | None:
        """(master changes, since ms): since the window's start when the console has watched
        that long, else since its first look; None for a group never seen."""
        samples = self._samples.get(group)
        if not samples:
            return None
        first_ms, first_epoch = samples[0]
        return max(0, samples[-1][1] - first_epoch), max(first_ms, now_ms - self.window_ms)


def master_changes_text(changes: tuple[int, int] | None, now_ms: int, window_ms: int = HOUR_MS) -> str:
    if changes is None:
        return "not reported"
    n, since = changes
    return str(n) if since <= now_ms - window_ms else f"{n} since {iso(since)[11:16]} (first look)"
