"""Python client SDK: a batching producer and a pulling consumer, the batch as the unit.

No Python object per message on the hot path (``shared/ARCHITECTURE.md``, "Hot path"):
``send_many`` keeps a call's messages as columns, the batcher cuts wire batches out of
them as index ranges, groups them by delay group with numpy and builds one codec
``Batch`` per request; answers come back as arrays and are written into the call's
result arrays. The consumer hands out the pulled codec batch as it is and decodes ids,
payloads and tags only when asked.

Producer::

    async with Producer(StaticResolver(delay=["127.0.0.1:7001"], realtime=["127.0.0.1:7002"])) as p:
        fut = await p.send_many("orders.cancel", payloads, delay_ms=30 * 60_000)
        res = await fut               # BatchSendResult: ids, seqs, deliver_at_ms, duplicates, errors
        one = await (await p.send("orders.cancel", b"order 42", delay_ms=5000, id="order-42"))

* ``send_many`` returns one future per call, resolved with a ``BatchSendResult`` once
  every message has its final answer; a refused message is an entry of ``errors``
  (index -> ``cluster.errors`` exception), never an exception of the whole future.
* Ids not given are ``{random per-producer prefix}{counter in hex}``.
* A delayed message is pinned to delay group ``groups[crc32(id) % len(groups)]`` (over
  the sorted group names; ``group_for``): its sends and retries go to that group's
  master, whoever it is at the time, so a retry is de-duplicated, never stored twice.
* Each message is checked against ``codec.Limits`` before it is queued (numpy over the
  call): one over ``payload_bytes_max`` (``PayloadTooLarge``), with a due time out of
  range or an over-long id fails at once, alone, and is never sent (``_refusals``).
* The batcher sends at once when no request is on the wire; while some are, it waits
  up to ``linger_ms`` for ``batch_max`` messages (or
  ``batch_bytes_max`` estimated wire bytes: payload + id + extras +
  ``MESSAGE_OVERHEAD_BYTES``, at most ``BATCH_BYTES_MAX``, under gRPC's message limit)
  and keeps at most ``inflight_max`` requests on the wire; callers wait once
  ``queue_max`` messages are queued.
* Retryable answers (``status.RETRYABLE_CODES``, node down, not leader) are retried,
  those indices only, with jittered exponential backoff (tenacity) up to
  ``retries_max`` times, re-resolving the target each time. ``DiskFull`` is not retried
  (``status.retryable``): the messages it refused get it at once, with the node's address
  and free space (space comes back when retention or an operator frees it).
* Every call has a deadline, ``call_timeout_s`` from the call (``asyncio.timeout``
  around the retried call, and a timer per call that fails what is still unanswered,
  wherever it waits): then ``Unavailable`` saying what was tried and the last error.
* ``send`` / ``send_message`` / ``send_and_wait`` are the convenience layer: one future
  per message (a ``SendResult``); consecutive ``send`` calls share one queued call.

Consumer::

    async with Consumer(resolver, ["orders.cancel", "orders.remind"], group="billing") as c:
        async for batch in c.batches():          # ReceivedBatch: lazy ids / payloads / lateness_ms
            handle(batch.payloads)
            await batch.ack()                    # the whole batch, as handle ranges
        async for msg in c:                      # or one Received at a time
            await msg.ack()

Subjects are grouped by the real-time nodes each maps to (``resolver.realtime_route``:
every master of the subject's real-time groups, ``cluster/routes.py``) and each node is
pulled with one long-poll request; a message is acked to the node it came from; a node's answer is handed out
as soon as it arrives while the other nodes' pulls stay in flight. The server
filters tags by hash; the client checks exactly and acks the non-matching away.
``close()`` cancels in-flight pulls (a message the server had handed to a cancelled
pull is redelivered after its visibility timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import secrets
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from operator import itemgetter
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from cluster import errors as E
from cluster import status
from cluster.clock import wall_ms as _now_ms
from cluster.codec import (COLUMN_BYTES, DEFAULT_LIMITS, OK, SUBJECTS_MAX, Batch, Limits, check_subject, encode_extra,
                           subject_problem)
from cluster.proto import hourglass_pb2 as pb
from cluster.routes import RouteView
from cluster.trace import hops as trace_hops
from cluster.clientsettings import ACK_LINGER_MS_MAX, CLIENT_DEFAULTS, ClientSettings
from cluster.security import ClientSecurity
from cluster.transport import MESSAGE_BYTES_MAX, Channels
from cluster.wire import SMALL_RANGES_MAX, BatchResult, make_request, pack_ranges, range_pairs

log = logging.getLogger("hourglass.client")

ORIGIN_ID = "hourglass.origin_id"  # a retried message's original id (set by the real-time node)
ID_PREFIX_BYTES = 8                # random bytes of a producer's id prefix (16 hex characters)
_RETRYABLE = np.zeros(256, bool)  # per-message answer code (u8) -> retried (one lookup per answer)
_RETRYABLE[sorted(status.RETRYABLE_CODES)] = True

# every default of the SDK: cluster/clientsettings.py (the keyword defaults below refer to it)
_CALLS, _PRODUCER, _CONSUMER = CLIENT_DEFAULTS.calls, CLIENT_DEFAULTS.producer, CLIENT_DEFAULTS.consumer
# A wire batch's bytes are estimated per message as payload + id + extras + MESSAGE_OVERHEAD_BYTES
# (its 49 bytes of columns and its 8-byte delay_ms entry). The estimate leaves out the subject
# table, ids beyond ASCII and protobuf framing; REQUEST_MARGIN_BYTES covers them (at most
# batch_messages_max x (3 x id_bytes_max + subject_bytes_max + 2) bytes, under 6 MiB).
MESSAGE_OVERHEAD_BYTES = COLUMN_BYTES + 8
REQUEST_MARGIN_BYTES = 16 * 1024 * 1024
# the most any Producer may set ``batch_bytes_max`` to: under the gRPC message limit the nodes
# and the SDK's channels use (``transport.MESSAGE_BYTES_MAX``, node ``request_bytes_max``)
BATCH_BYTES_MAX = min(MESSAGE_BYTES_MAX, DEFAULT_LIMITS.batch_bytes_max) - REQUEST_MARGIN_BYTES
SEND_JOIN_S = 0.1  # a ``send`` joins the open job only this long after it opened (its deadline is that much early)


def _backoff(min_ms: int, max_ms: int) -> wait_random_exponential:
    """The one backoff of the SDK: full-jitter exponential from ``min_ms`` up to ``max_ms``."""
    return wait_random_exponential(multiplier=min_ms / 1000, max=max_ms / 1000)


def _pause_s(wait: wait_random_exponential, failures: int) -> float:
    """The pause ``wait`` gives after ``failures`` failures in a row (outside a tenacity loop)."""
    state = RetryCallState(None, None, (), {})
    state.attempt_number = failures
    return wait(state)


# ---------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class SendResult:
    id: str
    seq: int
    deliver_at_ms: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class CancelResult:
    id: str
    seq: int


@dataclass(frozen=True, slots=True)
class BrowsePage:
    """One ``Consumer.browse``: the messages (their ``handle`` is their position in the
    subject), where to browse on, and the subject's end position."""
    messages: list
    next_position: int
    end_position: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    id: str
    status: str
    seq: int
    deliver_at_ms: int
    subject: str
    accepted_ms: int = 0       # when the delay group accepted it (0: not known)
    effective_ms: int = 0      # the time it is filed under and fires at (0: not filed yet)
    cancelled_ms: int = 0      # cancelled: when the cancel was accepted
    store_epoch: int = 0       # the delay group's store epoch (term) that accepted it
    accepted_node_id: str = ""  # the node that took that term ("": not named, data older than the term table)
    dispatched_ms: int = 0     # dispatched: when (0: not known, node/delay/dispatch_find.py)
    dead_lettered: bool = False  # dispatched to the dead letters by the delay node
    realtime_group: str = ""   # the real-time group its route and id name now
    realtime_address: str = ""  # that group's master now
    group: str = ""            # the delay group that answered (holds the record)
    node_id: str = ""          # the member that answered (its master now)


@dataclass(frozen=True, slots=True)
class GroupTrace:
    """What one consumer group did with a message (``Consumer/Trace``)."""
    group: str
    state: str                 # waiting | in_flight | acked | nacked | dead_lettered
    copy_id: str = ""          # nacked / dead_lettered: the copy's id
    copy_subject: str = ""
    copy_ms: int = 0


@dataclass(frozen=True, slots=True)
class RealtimeTrace:
    """A real-time node's answer to ``Consumer/Trace``: where it stored the message."""
    node_id: str
    group: str
    position: int
    seq: int
    stored_ms: int
    attempts: int
    found_by: str              # window | scan
    groups: list[GroupTrace]


@dataclass(frozen=True, slots=True)
class MessageTrace:
    """``Producer.trace``: the delay Lookup, the real-time node's answer once it was
    dispatched (None: not dispatched, or ``realtime_error`` says why it is missing)."""
    lookup: LookupResult
    realtime: RealtimeTrace | None = None
    realtime_error: str = ""

    def as_dict(self) -> dict:
        """The dict ``cluster.trace.hops`` reads."""
        return {**asdict(self.lookup), "realtime": asdict(self.realtime) if self.realtime else None,
                "realtime_error": self.realtime_error}

    def hops(self, now_ms: int) -> list:
        """The hops, in order (``cluster.trace.Hop``)."""
        return trace_hops(self.as_dict(), now_ms)


@dataclass(slots=True)
class BatchSendResult:
    """The answers of one ``send_many`` call, index i for message i. ``seqs`` is 0 and
    ``errors[i]`` the ``cluster.errors`` exception where message i was refused."""

    ids: list[str]
    seqs: np.ndarray
    deliver_at_ms: np.ndarray
    duplicates: np.ndarray
    errors: dict[int, E.HourglassError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def ok(self) -> bool:
        return not self.errors

    def result(self, i: int) -> SendResult:
        """Message i's answer; raises its error if it was refused."""
        if i in self.errors:
            raise self.errors[i]
        return SendResult(self.ids[i], int(self.seqs[i]), int(self.deliver_at_ms[i]), bool(self.duplicates[i]))


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message for ``Producer.send_message`` (the convenience API)."""

    subject: str
    payload: bytes | str = b""
    id: str = ""
    delay_ms: int = 0
    deliver_at_ms: int = 0
    tags: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    immediate: bool = False


# ---------------------------------------------------------------------- discovery


class StaticResolver:
    """Fixed node lists. Subjects map to real-time nodes by a stable hash, the same
    rule the delay nodes use, so producers, delay nodes and consumers agree."""

    def __init__(self, *, delay: list[str] = (), realtime: list[str] = (),
                 security: ClientSecurity | None = None) -> None:
        self.delay = list(delay)
        self.realtime = list(realtime)
        self.security = security  # None: HOURGLASS_TLS_* / HOURGLASS_TOKEN from the environment

    async def delay_nodes(self) -> list[str]:
        if not self.delay:
            raise E.Unavailable("no delay node known")
        return self.delay

    async def delay_groups(self) -> list[tuple[str, str]]:
        """Without a meta server each delay node is a group of its own."""
        if not self.delay:
            raise E.Unavailable("no delay node known")
        return [(a, a) for a in self.delay]

    async def realtime_for(self, subject: str) -> str:
        if not self.realtime:
            raise E.Unavailable("no real-time node known")
        return self.realtime[zlib.crc32(subject.encode()) % len(self.realtime)]

    async def refresh(self) -> None:
        pass

    @property
    def routes_version(self) -> int:
        """Changes when the lists do (``MetaResolver.routes_version``)."""
        return hash(tuple(self.realtime))

    def invalidate(self, subject: str) -> None:
        """A route failed (the delay node's dispatch says so): fixed lists have nothing to forget."""

    def describe(self) -> str:
        """Where this resolver looks (for errors that say what was tried)."""
        return f"static delay={','.join(self.delay) or '-'} realtime={','.join(self.realtime) or '-'}"

    async def close(self) -> None:
        pass


async def route_of(resolver, subject: str) -> RouteView:
    """The subject's route from ``resolver``: ``realtime_route`` when it has one, else the one
    node of ``realtime_for`` (a resolver written before routes were lists)."""
    realtime_route = getattr(resolver, "realtime_route", None)
    if realtime_route is not None:
        return await realtime_route(subject)
    address = await resolver.realtime_for(subject)
    if not address:
        raise E.Unavailable(f"no real-time node known for subject {subject!r}")
    return RouteView.single(address)


def _describe(resolver) -> str:
    describe = getattr(resolver, "describe", None)
    return describe() if callable(describe) else type(resolver).__name__


def group_for(msg_id: str, groups: list[tuple[str, str]]) -> str:
    """The delay group a message id belongs to: a stable hash over the sorted group names.
    Sends, retries and re-sends of one id go to one group (ids are de-duplicated per group),
    and cancel/lookup ask that group first. ``_route_delayed`` applies it to a whole call."""
    if not groups:
        raise E.Unavailable("no delay group registered")
    return groups[zlib.crc32(msg_id.encode()) % len(groups)][0]


# ---------------------------------------------------------------------- producer internals

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def _column(v, n: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """An i64 column of n entries from None (zeros), one int (for all) or a sequence, and the
    mask of entries that do not fit in an i64 (0 in the column; None when there are none)."""
    if v is None:
        return np.zeros(n, np.int64), None
    if isinstance(v, (int, np.integer)):
        if I64_MIN <= v <= I64_MAX:
            return np.full(n, v, np.int64), None
        return np.zeros(n, np.int64), np.ones(n, bool)
    try:
        a, bad = np.asarray(v, np.int64), None
    except OverflowError:  # a value beyond i64: found one by one, only on this error path
        vals = list(v)
        bad = np.array([not I64_MIN <= x <= I64_MAX for x in vals], bool)
        a = np.array([0 if b else x for x, b in zip(vals, bad.tolist())], np.int64)
    if a.shape != (n,):
        raise E.InvalidArgument(name, f"{a.shape} entries for {n} messages")
    return a, bad


def _refusals(subjects: str | list[str], pay_lens: np.ndarray, id_lens: np.ndarray, deliver: np.ndarray,
              delay: np.ndarray | None, unfit: np.ndarray | None, now_ms: int,
              limits: Limits) -> dict[int, E.HourglassError]:
    """The messages a node would refuse for their subject (``codec.subject_problem``), size or
    due time (``codec.Limits``), as index -> error: they fail at once, alone, and are never
    sent. One reduction per rule when all is well."""
    out: dict[int, E.HourglassError] = {}

    def refuse(mask: np.ndarray, make: Callable[[int], E.HourglassError]) -> None:
        if mask.any():
            for i in np.flatnonzero(mask).tolist():
                if i not in out:
                    out[i] = make(i)

    n = len(pay_lens)
    if isinstance(subjects, str):
        bad = {subjects: p} if (p := subject_problem(subjects, limits.subject_bytes_max)) else {}
        if bad:
            refuse(np.ones(n, bool), lambda i: E.InvalidArgument("subject", bad[subjects]))
    else:
        bad = {s: p for s in set(subjects) if (p := subject_problem(s, limits.subject_bytes_max))}
        if bad:
            refuse(np.fromiter((s in bad for s in subjects), bool, n),
                   lambda i: E.InvalidArgument("subject", f"message {i}: {bad[subjects[i]]}"))
    horizon = limits.delay_horizon_ms
    if unfit is not None:
        refuse(unfit, lambda i: E.InvalidArgument("deliver_at_ms/delay_ms", f"message {i}: not a 64-bit integer"))
    refuse(pay_lens > limits.payload_bytes_max, lambda i: E.PayloadTooLarge(
        "payload", f"message {i}: {int(pay_lens[i])} bytes exceeds payload_bytes_max {limits.payload_bytes_max}"))
    refuse(id_lens > limits.id_bytes_max, lambda i: E.InvalidArgument(
        "id", f"message {i}: {int(id_lens[i])} characters exceeds id_bytes_max {limits.id_bytes_max}"))
    refuse(deliver < 0, lambda i: E.InvalidArgument("deliver_at_ms", f"message {i}: must not be negative"))
    refuse(deliver > now_ms + horizon, lambda i: E.InvalidArgument(
        "deliver_at_ms", f"message {i}: {int(deliver[i])} is more than delay_horizon_ms {horizon} ahead"))
    if delay is not None:
        refuse(delay < 0, lambda i: E.InvalidArgument("delay_ms", f"message {i}: must not be negative"))
        refuse(delay > horizon, lambda i: E.InvalidArgument(
            "delay_ms", f"message {i}: {int(delay[i])} exceeds delay_horizon_ms {horizon}"))
    return out


def _refusal(subject: str, payload: bytes, msg_id: str, deliver_at_ms: int, delay_ms: int, now_ms: int,
             limits: Limits) -> E.HourglassError | None:
    """``_refusals`` for one message of ``send`` (plain ints; nothing can overflow)."""
    problem = subject_problem(subject, limits.subject_bytes_max)
    if problem is not None:
        return E.InvalidArgument("subject", problem)
    horizon = limits.delay_horizon_ms
    if len(payload) > limits.payload_bytes_max:
        return E.PayloadTooLarge("payload", f"{len(payload)} bytes exceeds payload_bytes_max {limits.payload_bytes_max}")
    if len(msg_id) > limits.id_bytes_max:
        return E.InvalidArgument("id", f"{len(msg_id)} characters exceeds id_bytes_max {limits.id_bytes_max}")
    if deliver_at_ms < 0 or delay_ms < 0:
        return E.InvalidArgument("delay_ms" if delay_ms < 0 else "deliver_at_ms", "must not be negative")
    if deliver_at_ms > now_ms + horizon:
        return E.InvalidArgument("deliver_at_ms", f"{deliver_at_ms} is more than delay_horizon_ms {horizon} ahead")
    if delay_ms > horizon:
        return E.InvalidArgument("delay_ms", f"{delay_ms} exceeds delay_horizon_ms {horizon}")
    return None


def _extras(tags, properties, n: int) -> list[bytes] | None:
    """One extras blob per message, or None when no message has tags or properties.
    ``tags``: strings (every message) or one sequence per message; ``properties``: a dict
    (every message) or one dict per message."""
    if not tags and not properties:
        return None
    per_tags = bool(tags) and not isinstance(tags[0], str)
    per_props = properties is not None and not isinstance(properties, dict)
    if per_tags and len(tags) != n or per_props and len(properties) != n:
        raise E.InvalidArgument("tags/properties", f"give one for all or one per message ({n})")
    if not per_tags and not per_props:
        return [encode_extra(tuple(tags or ()), properties or {})] * n
    t = tags if per_tags else [tuple(tags or ())] * n
    p = properties if per_props else [properties or {}] * n
    return [encode_extra(tuple(a), b or {}) for a, b in zip(t, p)]


class _Job:
    """One ``send_many`` call, or a run of ``send`` calls gathered in one (``futures``):
    its columns, how far the batcher has cut into it, its answers as arrays, its deadline
    and what was tried for it (for the error its messages get at the deadline)."""

    __slots__ = ("n", "ids", "subjects", "payloads", "extras", "deliver", "delay", "immediate", "future",
                 "futures", "sealed", "taken", "crc", "size_end", "seqs", "due", "dups", "done", "left", "errors",
                 "refused", "deadline", "timer", "tried", "attempts", "why", "subject_col")

    def __init__(self, ids: list[str], subjects, payloads: list[bytes], extras: list[bytes] | None, deliver,
                 delay, immediate: bool, future: asyncio.Future | None, futures: list | None = None, *,
                 deadline: float = float("inf")) -> None:
        self.ids = ids
        self.subjects = subjects  # one str for all, or a list
        self.payloads = payloads
        self.extras = extras
        self.deliver = deliver
        self.delay = delay
        self.immediate = immediate
        self.future = future
        self.futures = futures
        self.n = len(ids)
        self.sealed = False
        self.taken = 0
        self.size_end: np.ndarray | None = None
        self.refused = False  # some messages were refused before sending (``done`` before taken)
        self.deadline = deadline  # loop time
        self.timer: asyncio.TimerHandle | None = None
        self.tried: dict[str, int] = {}  # address -> requests sent there carrying messages of this job
        self.attempts = 0
        self.why: BaseException | None = None  # the last reason a retry was needed
        self.subject_col: tuple[tuple[str, ...], np.ndarray] | None = None  # ``_subject_column``, once sealed

    def seal(self, sizes: np.ndarray | None = None) -> None:
        """No more messages join; build the arrays the batcher cuts and answers fill.
        ``sizes``: each message's estimated wire bytes (worked out here when not given)."""
        n = self.n = len(self.ids)
        self.sealed = True
        self.deliver = np.asarray(self.deliver, np.int64)
        if self.delay is not None:
            delay = np.asarray(self.delay, np.int64)
            self.delay = delay if delay.any() else None
        self.crc = None  # crc32 of each id, computed when there is more than one delay group
        if sizes is None:
            sizes = np.fromiter(map(len, self.payloads), np.int64, n) + \
                np.fromiter(map(len, self.ids), np.int64, n) + MESSAGE_OVERHEAD_BYTES
            if self.extras is not None:
                sizes += np.fromiter(map(len, self.extras), np.int64, n)
        self.size_end = np.cumsum(sizes)
        self.seqs = np.zeros(n, np.uint64)
        self.due = np.zeros(n, np.int64)
        self.dups = np.zeros(n, bool)
        self.done = np.zeros(n, bool)
        self.left = n
        self.errors: dict[int, E.HourglassError] = {}

    def note(self, address: str | None = None, why: BaseException | None = None) -> None:
        """Remember a request sent for this job (to ``address``) or why one must be tried again."""
        if address is not None:
            self.tried[address] = self.tried.get(address, 0) + 1
            self.attempts += 1
        if why is not None:
            self.why = why

    def tried_text(self) -> str:
        if not self.tried:
            return "no request sent"
        return f"{self.attempts} requests to " + ", ".join(f"{a} (x{k})" for a, k in self.tried.items())


# a piece of a wire batch: messages ``idx`` (ascending) of a job, pinned to a delay group once routed
_Piece = tuple[_Job, np.ndarray, "str | None"]


def _unanswered(pieces: list[_Piece]) -> list[_Piece]:
    """``pieces`` without the messages that already have their final answer (expired ones)."""
    out = []
    for job, idx, group in pieces:
        d = job.done[idx]
        if not d.any():
            out.append((job, idx, group))
        elif not d.all():
            out.append((job, idx[~d], group))
    return out


def _pick(values: list, idx: np.ndarray) -> list:
    a, b = int(idx[0]), int(idx[-1]) + 1
    if b - a == len(idx):
        return values[a:b]
    return [values[i] for i in idx.tolist()]


def _subject_column(job: _Job) -> tuple[tuple[str, ...], np.ndarray]:
    """A job's subjects as a table (first appearance) and an index per message, made once per
    job and in C loops (``dict.fromkeys``, ``map``), not a Python step per message."""
    if job.subject_col is None:
        table = tuple(dict.fromkeys(job.subjects))
        number = {s: k for k, s in enumerate(table)}
        job.subject_col = table, np.fromiter(map(number.__getitem__, job.subjects), np.int64, len(job.subjects))
    return job.subject_col


def _subject_idx(pieces: list[_Piece], order: np.ndarray | None) -> tuple[tuple[str, ...], np.ndarray] | str:
    """The subject table and index column of a wire batch of ``pieces`` (in ``order``), as
    ``Batch.build`` makes them from a list of names: the table in order of first appearance,
    only subjects the batch carries; or the one subject when every message has it."""
    names: dict[str, int] = {}
    parts = []
    for job, idx, _ in pieces:
        if isinstance(job.subjects, str):
            parts.append(np.full(len(idx), names.setdefault(job.subjects, len(names)), np.int64))
        else:
            table, col = _subject_column(job)
            remap = np.fromiter((names.setdefault(t, len(names)) for t in table), np.int64, len(table))
            parts.append(remap[col[idx]])
    if len(names) == 1:
        return next(iter(names))
    g = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if order is not None:
        g = g[order]
    # renumber by first appearance: the codec's table order for the same list of names (each
    # name's first position by ``minimum.at``, a third of ``np.unique``'s cost; a name the
    # batch does not carry keeps len(g) and sorts last)
    k, m = len(names), len(g)
    first = np.full(k, m, np.int64)
    np.minimum.at(first, g, np.arange(m))
    by_first = np.argsort(first, kind="stable")
    used = int(np.count_nonzero(first < m))
    if used > SUBJECTS_MAX:
        raise E.InvalidArgument("batch", f"more than {SUBJECTS_MAX} subjects in one batch")
    rank = np.empty(k, np.int64)
    rank[by_first] = np.arange(k)
    table = tuple(names)
    return tuple(table[i] for i in by_first[:used].tolist()), rank[g].astype(np.uint16)


def _build(pieces: list[_Piece], *, immediate: bool = False) -> tuple[Batch, np.ndarray | None, np.ndarray | None]:
    """The codec batch (and delay column) of a wire request made of ``pieces``, sorted by
    due time (stable), and the order that sorted it (None: it already was, or the batch is
    ``immediate``: a real-time node stores it in the order it was sent). A delay node files
    a batch by due second: records already in due order are filed as slices of the frame
    it received, with no per-record copy (``ScheduleLog.file``); the sort is done here, in
    the producer's process, once per wire batch. Nothing here steps through the messages in
    Python: lists are sliced and permuted by C calls (``itemgetter``), subjects are numbered
    once per job (``_subject_column``)."""
    ids: list[str] = []
    payloads: list[bytes] = []
    any_extras = any(j.extras is not None for j, _, _ in pieces)
    extras: list[bytes] = []
    for job, idx, _ in pieces:
        ids += _pick(job.ids, idx)
        payloads += _pick(job.payloads, idx)
        if any_extras:
            extras += _pick(job.extras, idx) if job.extras is not None else [b""] * len(idx)
    deliver = np.concatenate([j.deliver[idx] for j, idx, _ in pieces])
    delay = None
    if any(j.delay is not None for j, _, _ in pieces):
        delay = np.concatenate([j.delay[idx] if j.delay is not None else np.zeros(len(idx), np.int64)
                                for j, idx, _ in pieces])
    key = deliver if delay is None else np.where(delay != 0, _now_ms() + delay, deliver)
    order = None
    if not immediate and len(key) > 1 and bool((key[1:] < key[:-1]).any()):
        order = np.argsort(key, kind="stable")
        permute = itemgetter(*order.tolist())  # at least two: a tuple
        ids, payloads, deliver = permute(ids), permute(payloads), deliver[order]
        if any_extras:
            extras = permute(extras)
        if delay is not None:
            delay = delay[order]
    subjects = _subject_idx(pieces, order)
    if isinstance(subjects, str):
        batch = Batch.build(subjects, payloads, ids, deliver, extras=extras if any_extras else None)
    else:
        table, sidx = subjects
        batch = Batch.build(table[0], payloads, ids, deliver, extras=extras if any_extras else None)
        batch = batch.replace(subjects=table, subject_idx=sidx)
    return batch, delay, order


def _unsorted(res: BatchResult, order: np.ndarray | None) -> BatchResult:
    """The answer to a batch ``_build`` sorted, in the order of its pieces again."""
    if order is None:
        return res
    out = BatchResult.sized(res.n)
    out.codes[order] = res.codes
    out.seqs[order] = res.seqs
    out.deliver_at_ms[order] = res.deliver_at_ms
    out.duplicates[order] = res.duplicates
    out.errors = {int(order[k]): e for k, e in res.errors.items()}
    return out


# A wire batch up to this size goes on the node's ordered stream (``SendBatchStream``,
# docs/api.md "Ordered streams"): a message on an open stream costs the node about a third of
# a unary call's CPU and the round trip about half its time (``bench/bench_grpc.py``), paid
# once per call. A larger one goes as a unary ``SendBatch``: its own cost dwarfs the call's,
# and it does not hold the stream's later requests behind its transfer.
STREAM_REQUEST_BYTES_MAX = 1 << 20


def _too_large_for_grpc(err: grpc.RpcError) -> bool:
    """gRPC's own refusal to send a request over its message size limit: never worth a retry."""
    return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (err.details() or "")


# ---------------------------------------------------------------------- producer


class Producer:
    def __init__(self, resolver, *, linger_ms: int = _PRODUCER.linger_ms, batch_max: int = _PRODUCER.batch_max,
                 batch_bytes_max: int = _PRODUCER.batch_bytes_max, inflight_max: int = _PRODUCER.inflight_max,
                 queue_max: int = _PRODUCER.queue_max, timeout_s: float = _CALLS.timeout_s,
                 call_timeout_s: float = _CALLS.call_timeout_s, retries_max: int = _PRODUCER.retries_max,
                 backoff_ms_min: int = _CALLS.backoff_ms_min, backoff_ms_max: int = _CALLS.backoff_ms_max,
                 limits: Limits = CLIENT_DEFAULTS.limits, security: ClientSecurity | None = None) -> None:
        if not 0 < batch_bytes_max <= BATCH_BYTES_MAX:
            raise E.InvalidArgument("batch_bytes_max", f"{batch_bytes_max} is not in 1..{BATCH_BYTES_MAX} "
                                    f"(the gRPC message limit {MESSAGE_BYTES_MAX} less {REQUEST_MARGIN_BYTES})")
        if not 0 < batch_max <= limits.batch_messages_max:
            raise E.InvalidArgument("batch_max", f"{batch_max} is not in 1..{limits.batch_messages_max}")
        if not call_timeout_s > 0:
            raise E.InvalidArgument("call_timeout_s", "must be positive")
        self.resolver = resolver
        self.linger_ms = linger_ms
        self.batch_max = batch_max
        self.batch_bytes_max = batch_bytes_max
        self.queue_max = queue_max
        self.timeout_s = timeout_s            # one request
        self.call_timeout_s = call_timeout_s  # one call, retries included
        self.retries_max = retries_max
        self.backoff_ms_min = backoff_ms_min
        self.backoff_ms_max = backoff_ms_max
        self.limits = limits
        self.channels = Channels(security or getattr(resolver, "security", None))
        self._id_prefix = secrets.token_hex(ID_PREFIX_BYTES)
        self._id_next = 0
        self._queue: deque[_Job] = deque()
        self._queued = 0          # messages queued, not yet cut into a wire batch
        self._unanswered = 0      # messages without a final answer
        self._open: _Job | None = None  # the job ``send`` calls are appended to
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = asyncio.Semaphore(inflight_max)
        self._batcher: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()
        self._closed = False

    @classmethod
    def from_settings(cls, resolver, settings: ClientSettings, *, security: ClientSecurity | None = None) -> "Producer":
        """A producer with every value from ``settings`` (its ``calls``, ``producer`` and ``limits``)."""
        return cls(resolver, **settings.calls.model_dump(), **settings.producer.model_dump(), limits=settings.limits,
                   security=security)

    async def __aenter__(self) -> "Producer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls

    def new_ids(self, n: int) -> list[str]:
        """n fresh ids: this producer's random prefix and a counter (hex)."""
        start, self._id_next = self._id_next, self._id_next + n
        prefix = self._id_prefix
        return [f"{prefix}{k:x}" for k in range(start, start + n)]

    async def send_many(self, subjects: str | Sequence[str], payloads: Sequence[bytes], *,
                        ids: Sequence[str] | None = None, deliver_at_ms=None, delay_ms=None, tags=None,
                        properties=None, immediate: bool = False) -> asyncio.Future:
        """Queue ``payloads`` as one call; returns a future of its ``BatchSendResult``.

        ``subjects``: one for all or one per message. ``deliver_at_ms`` (absolute) and
        ``delay_ms`` (from the node's receive time): None, one int for all or one per
        message, not both for one message. ``tags``/``properties``: see ``_extras``.
        ``immediate``: deliver now, through the subject's real-time node. Waits only
        while ``queue_max`` messages are queued. Malformed arguments raise at once; a
        message over a limit (payload size, due time out of range) gets its error in
        ``errors`` at once and is not sent, the others are. The future is resolved
        within ``call_timeout_s``: what has no answer by then fails with ``Unavailable``."""
        if self._closed:
            raise E.Closed("producer closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout_s
        payloads = list(payloads)
        n = len(payloads)
        if not set(map(type, payloads)) <= {bytes}:
            payloads = [p.encode() if isinstance(p, str) else bytes(p) for p in payloads]
        if not isinstance(subjects, str):
            subjects = list(subjects)
            if len(subjects) != n:
                raise E.InvalidArgument("subjects", f"{len(subjects)} subjects for {n} payloads")
            if not set(map(type, subjects)) <= {str}:
                raise E.InvalidArgument("subjects", "every subject must be a str")
        if ids is None:
            ids = self.new_ids(n)
            id_lens = np.full(n, len(ids[-1]) if n else 0, np.int64)  # the last is the longest
        else:
            ids = list(ids)
            if len(ids) != n:
                raise E.InvalidArgument("ids", f"{len(ids)} ids for {n} payloads")
            if not set(map(type, ids)) <= {str}:
                raise E.InvalidArgument("ids", "every id must be a str")
            id_lens = np.fromiter(map(len, ids), np.int64, n)
        deliver, unfit = _column(deliver_at_ms, n, "deliver_at_ms")
        delay = None
        if delay_ms is not None:
            delay, unfit_delay = _column(delay_ms, n, "delay_ms")
            unfit = unfit_delay if unfit is None else unfit if unfit_delay is None else unfit | unfit_delay
            if ((delay != 0) & (deliver != 0)).any():
                raise E.InvalidArgument("deliver_at_ms", "give deliver_at_ms or delay_ms, not both")
        extras = _extras(tags, properties, n)
        pay_lens = np.fromiter(map(len, payloads), np.int64, n)
        refused = _refusals(subjects, pay_lens, id_lens, deliver, delay, unfit, _now_ms(), self.limits)
        sizes = pay_lens + id_lens + MESSAGE_OVERHEAD_BYTES
        if extras is not None:
            sizes += np.fromiter(map(len, extras), np.int64, n)
        fut = loop.create_future()
        job = _Job(ids, subjects, payloads, extras, deliver, delay, immediate, fut, deadline=deadline)
        if refused:
            sizes[list(refused)] = 0  # never sent: they take no room in a wire batch
        job.seal(sizes)
        if len(refused) == n:  # nothing to send (or an empty call)
            job.errors.update(refused)
            job.done[:] = True
            job.left = 0
            self._complete(job, counted=False)
            return fut
        await self._wait_room(n - len(refused), deadline)
        self._enqueue(job, n)
        if refused:
            job.refused = True
            job.errors.update(refused)
            self._settle(job, np.fromiter(refused, np.int64, len(refused)))
        return fut

    async def send(self, subject: str, payload: bytes | str = b"", *, delay_ms: int = 0, deliver_at_ms: int = 0,
                   id: str = "", tags: Sequence[str] = (), properties: dict[str, str] | None = None,
                   immediate: bool = False) -> asyncio.Future:
        """Queue one message; returns a future of its ``SendResult`` (or its error), resolved
        within ``call_timeout_s``. A message over a limit fails its future at once."""
        if self._closed:
            raise E.Closed("producer closed")
        if delay_ms and deliver_at_ms:
            raise E.InvalidArgument("deliver_at_ms", "give deliver_at_ms or delay_ms, not both")
        if isinstance(payload, str):
            payload = payload.encode()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        bad = _refusal(subject, payload, id, deliver_at_ms, delay_ms, _now_ms(), self.limits)
        if bad is not None:
            fut.set_exception(bad)
            return fut
        now = loop.time()
        await self._wait_room(1, now + self.call_timeout_s)
        job = self._open
        if (job is None or job.sealed or job.immediate != immediate or len(job.ids) >= self.batch_max
                or job.deadline < now + self.call_timeout_s - SEND_JOIN_S):
            job = self._open = _Job([], [], [], None, [], [], immediate, None, [],
                                    deadline=now + self.call_timeout_s)
            self._enqueue(job, 0)
        extra = encode_extra(tuple(tags), properties or {}) if tags or properties else b""
        if extra and job.extras is None:
            job.extras = [b""] * len(job.ids)
        if job.extras is not None:
            job.extras.append(extra)
        job.ids.append(id or self.new_ids(1)[0])
        job.subjects.append(subject)
        job.payloads.append(payload)
        job.deliver.append(deliver_at_ms)
        job.delay.append(delay_ms)
        job.futures.append(fut)
        self._count_in(1)
        return fut

    async def send_message(self, msg: OutgoingMessage) -> asyncio.Future:
        return await self.send(msg.subject, msg.payload, delay_ms=msg.delay_ms, deliver_at_ms=msg.deliver_at_ms,
                               id=msg.id, tags=msg.tags, properties=msg.properties, immediate=msg.immediate)

    async def send_and_wait(self, subject: str, payload: bytes | str = b"", **kw) -> SendResult:
        """``send`` and its answer: returns or raises within ``call_timeout_s``."""
        return await (await self.send(subject, payload, **kw))

    async def flush(self) -> None:
        """Wait until everything queued so far has its final answer (each call's by its deadline)."""
        await self._idle.wait()

    # ------------------------------------------------------------------ queue

    async def _wait_room(self, n: int, deadline: float) -> None:
        """Wait while ``queue_max`` messages are queued; ``Unavailable`` at ``deadline``."""
        if not (self._queued and self._queued + n > self.queue_max):
            return  # room now (nearly every call): no timeout armed and cancelled for nothing
        try:
            async with asyncio.timeout_at(deadline):
                while self._queued and self._queued + n > self.queue_max:
                    self._room.clear()
                    await self._room.wait()
                    if self._closed:
                        raise E.Closed("producer closed")
        except TimeoutError:
            raise E.Unavailable(f"the send queue stayed full ({self._queued} of queue_max={self.queue_max} "
                                f"messages) for call_timeout_s={self.call_timeout_s} s") from None

    def _enqueue(self, job: _Job, n: int) -> None:
        loop = asyncio.get_running_loop()
        if self._batcher is None:
            self._batcher = loop.create_task(self._batch_loop(), name="producer-batcher")
        job.timer = loop.call_at(job.deadline, self._expire, job)
        self._queue.append(job)
        self._count_in(n)

    def _count_in(self, n: int) -> None:
        self._queued += n
        self._unanswered += n
        if n:
            self._idle.clear()
            self._wake.set()

    def _take(self) -> dict[bool, list[_Piece]]:
        """Cut the next wire batch (at most ``batch_max`` messages and ``batch_bytes_max``
        estimated bytes, at least one message) off the queue, split delayed / immediate.
        Messages refused before sending, and jobs already answered (expired), are passed over."""
        out: dict[bool, list[_Piece]] = {}
        count = size = cut = 0
        while self._queue and count < self.batch_max:
            job = self._queue[0]
            if not job.sealed:
                job.seal()
            lo = job.taken
            if job.left == 0:  # every message has its answer: nothing of it goes out
                cut += job.n - lo
                job.taken = job.n
                self._queue.popleft()
                continue
            base = int(job.size_end[lo - 1]) if lo else 0
            hi = min(job.n, lo + self.batch_max - count,
                     int(np.searchsorted(job.size_end, base + self.batch_bytes_max - size, side="right")))
            if hi <= lo:
                if count:
                    break
                hi = lo + 1  # one message over a small byte budget still goes, alone (it is under the limits)
            idx = np.arange(lo, hi)
            if job.refused:
                idx = idx[~job.done[idx]]
            if len(idx):
                out.setdefault(job.immediate, []).append((job, idx, None))
            count += hi - lo
            size += int(job.size_end[hi - 1]) - base
            job.taken = hi
            if hi == job.n:
                self._queue.popleft()
        self._queued -= count + cut
        self._room.set()
        return out

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queued:
                self._wake.clear()
                await self._wake.wait()
            # linger only while requests are on the wire (issue 28): a message queued when none
            # is leaves at once (an awaited send pays no linger), and under load the messages
            # queued while requests run gather into the next one (batches grow with the rate).
            # On the wire: taken messages still without their answer (``_unanswered`` less the
            # queued), not the send tasks: an awaited caller's next call comes while the task
            # that answered its last one is still finishing, and lingered ``linger_ms`` for it
            deadline = loop.time() + (self.linger_ms / 1000 if self._unanswered > self._queued else 0.0)
            while self._queued < self.batch_max and (left := deadline - loop.time()) > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._wake.wait()
            for immediate, pieces in self._take().items():
                await self._inflight.acquire()
                t = loop.create_task(self._send_part(immediate, pieces))
                self._sending.add(t)
                t.add_done_callback(self._sending.discard)

    # ------------------------------------------------------------------ answers

    def _settle(self, job: _Job, idx: np.ndarray) -> None:
        """Messages ``idx`` of ``job`` have their final answer (written by the caller)."""
        job.done[idx] = True
        job.left -= len(idx)
        if job.left == 0:
            self._complete(job)

    def _fail(self, pieces: list[_Piece], err: E.HourglassError) -> None:
        """A final error for every message of ``pieces`` without an answer yet."""
        for job, idx, _ in pieces:
            idx = idx[~job.done[idx]]
            if not len(idx):
                continue
            job.seqs[idx] = 0
            for i in idx.tolist():
                job.errors[i] = err
            self._settle(job, idx)

    def _deadline_error(self, job: _Job) -> E.Unavailable:
        why = f"; last error: {job.why}" if job.why is not None else ""
        return E.Unavailable(f"no answer within call_timeout_s={self.call_timeout_s} s: {job.tried_text()}{why}")

    def _expire(self, job: _Job) -> None:
        """``job``'s deadline: whatever has no answer yet fails with ``Unavailable`` (queued,
        waiting for a request slot, or in flight; a late answer is then ignored)."""
        job.timer = None
        if not job.sealed:
            job.seal()
        if job.left:
            self._fail([(job, np.flatnonzero(~job.done), None)], self._deadline_error(job))

    def _complete(self, job: _Job, counted: bool = True) -> None:
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if job.futures is not None:
            seqs, due, dups = job.seqs.tolist(), job.due.tolist(), job.dups.tolist()
            for i, f in enumerate(job.futures):
                if f.done():
                    continue
                err = job.errors.get(i)
                if err is not None:
                    f.set_exception(err)
                else:
                    f.set_result(SendResult(job.ids[i], seqs[i], due[i], dups[i]))
        elif not job.future.done():
            job.future.set_result(BatchSendResult(job.ids, job.seqs, job.due, job.dups, job.errors))
        if counted:
            self._unanswered -= job.n
            if not self._unanswered:
                self._idle.set()

    def _answer(self, pieces: list[_Piece], res: BatchResult) -> tuple[list[_Piece], E.HourglassError | None]:
        """Write one SendBatch answer into the jobs; returns the pieces to retry and why.
        Messages that expired while the request was out keep their deadline error."""
        if not res.codes.any() and not any(job.done[idx].any() for job, idx, _ in pieces):
            # every message OK and still waiting (nearly every answer): its columns, written
            # as they came; the same as below with nothing to retry, refuse or pass over
            pos = 0
            for job, idx, _ in pieces:
                sl = slice(pos, pos + len(idx))
                job.seqs[idx] = res.seqs[sl]
                job.due[idx] = res.deliver_at_ms[sl]
                job.dups[idx] = res.duplicates[sl] != 0
                pos += len(idx)
                self._settle(job, idx)
            return [], None
        retry = _RETRYABLE[res.codes]
        if res.errors and retry.any():  # refused for a full disk or a quota: final (``status.retryable``)
            for i in np.flatnonzero(retry & (res.codes == pb.OVERLOADED)).tolist():
                if status.final_refusal(res.errors.get(i, "")):
                    retry[i] = False
        again: list[_Piece] = []
        why: E.HourglassError | None = None
        if retry.any():
            first = int(np.flatnonzero(retry)[0])
            why = status.from_code(int(res.codes[first]), res.errors.get(first, ""))
            if res.errors:
                self._note_moved(pieces, res.errors)
        pos = 0
        for job, idx, group in pieces:
            sl = slice(pos, pos + len(idx))
            live = ~job.done[idx]
            r = retry[sl] & live
            fin = ~retry[sl] & live
            fidx = idx[fin]
            codes = res.codes[sl][fin]
            job.seqs[fidx] = res.seqs[sl][fin]
            job.due[fidx] = res.deliver_at_ms[sl][fin]
            job.dups[fidx] = res.duplicates[sl][fin] != 0
            bad = np.flatnonzero(codes != OK)
            if len(bad):
                at = np.flatnonzero(fin)[bad] + pos  # positions in the wire batch
                for k, a in zip(bad.tolist(), at.tolist()):
                    job.errors[int(fidx[k])] = status.from_code(int(codes[k]), res.errors.get(a, ""))
            if r.any():
                again.append((job, idx[r], group))
            pos += len(idx)
            if len(fidx):
                self._settle(job, fidx)
        return again, why

    def _note_moved(self, pieces: list[_Piece], errors: dict[int, str]) -> None:
        """Messages a real-time node refused as "route moved" (a narrowing dropped its group):
        their subjects' routes are asked again before the retry, which hashes them over the
        groups of the new route (``_route_immediate``)."""
        moved = [i for i, e in errors.items() if e.startswith(status.ROUTE_MOVED_PREFIX)]
        note = getattr(self.resolver, "route_moved", None)
        if not moved or note is None:
            return
        pos, at = 0, sorted(moved)
        for job, idx, _ in pieces:
            for i in at:
                if pos <= i < pos + len(idx):
                    note(job.subjects if isinstance(job.subjects, str) else job.subjects[int(idx[i - pos])])
            pos += len(idx)

    # ------------------------------------------------------------------ the wire

    async def _send_part(self, immediate: bool, pieces: list[_Piece]) -> None:
        """Send pieces until every message has a final answer, retries run out or the
        deadline of the latest job among them passes (each job's own timer fails its
        messages at its own deadline)."""
        jobs = {id(j): j for j, _, _ in pieces}.values()

        async def round_(pieces: list[_Piece]) -> tuple[list[_Piece], E.Unavailable | None]:
            pieces = _unanswered(pieces)
            if not pieces:
                return pieces, None
            pieces, why = await self._attempt(immediate, pieces)
            if pieces:
                why = why if isinstance(why, E.Unavailable) else E.Unavailable(str(why))
                for job in {id(j): j for j, _, _ in pieces}.values():
                    job.note(why=why)
                await self.resolver.refresh()
            return pieces, why

        try:
            async with asyncio.timeout_at(max(j.deadline for j in jobs)):
                # the first attempt outside the retry loop: tenacity's per-attempt bookkeeping
                # cost about a tenth of a producer's CPU per call, and most calls need no retry
                pieces, first = await round_(pieces)
                if not pieces:
                    return
                async for attempt in AsyncRetrying(stop=stop_after_attempt(self.retries_max + 1),
                                                   wait=_backoff(self.backoff_ms_min, self.backoff_ms_max),
                                                   retry=retry_if_exception(status.retryable), reraise=True):
                    with attempt:
                        if first is not None:  # the loop's attempt 1 is the one above: wait, then retry
                            failed, first = first, None
                            raise failed
                        pieces, failed = await round_(pieces)
                        if pieces:
                            raise failed
        except TimeoutError:
            for job in jobs:
                self._fail([p for p in pieces if p[0] is job], self._deadline_error(job))
        except E.Unavailable as err:
            for job in jobs:
                self._fail([p for p in pieces if p[0] is job],
                           E.Unavailable(f"gave up after {self.retries_max} retries ({job.tried_text()}): {err}"))
        except asyncio.CancelledError:
            self._fail(pieces, E.Closed("producer closed before the message was acknowledged"))
            raise
        except Exception as err:  # a bug: no caller may wait forever for its answer
            log.exception("send failed")
            self._fail(pieces, E.HourglassError(f"internal error: {err!r}"))
        finally:
            self._inflight.release()

    async def _attempt(self, immediate: bool, pieces: list[_Piece]) -> tuple[list[_Piece], BaseException | None]:
        """One round: route the pieces, one SendBatch per node; returns what is left to retry."""
        try:
            routes, stuck, why = await (self._route_immediate(pieces) if immediate else self._route_delayed(pieces))
        except E.Unavailable as err:
            return pieces, err
        if len(routes) == 1:  # one node (most calls): no task and gather of its own to wait for
            ((address, ps),) = routes.items()
            outs = [await self._send_to(address, ps, immediate)]
        else:
            outs = await asyncio.gather(*(self._send_to(a, ps, immediate) for a, ps in routes.items()))
        left = list(stuck)
        for again, err in outs:
            left += again
            why = why or err
        return left, why

    async def _delay_groups(self) -> list[tuple[str, str]]:
        groups = await self.resolver.delay_groups()
        if not groups:
            raise E.Unavailable(f"no delay group registered ({_describe(self.resolver)})")
        return groups

    async def _route_delayed(self, pieces: list[_Piece]):
        """Pin unpinned pieces to their delay group (numpy over the crc32 of the ids) and
        map groups to their masters now; a group without a master keeps its pieces back."""
        groups = await self._delay_groups()
        names = [g for g, _ in groups]
        masters = dict(groups)
        routes: dict[str, list[_Piece]] = {}
        stuck: list[_Piece] = []
        why = None
        for job, idx, group in pieces:
            if group is not None and group not in masters:
                group = None  # its group left the list (drained, it refused): pinned again among the others
            if group is None and len(names) == 1:
                parts = [(job, idx, names[0])]
            elif group is None:
                if job.crc is None:
                    job.crc = np.fromiter(map(zlib.crc32, map(str.encode, job.ids)), np.int64, job.n)
                gi = job.crc[idx] % len(names)
                parts = [(job, idx, names[int(gi[0])])] if (gi == gi[0]).all() else \
                    [(job, idx[gi == k], names[k]) for k in np.unique(gi).tolist()]
            else:
                parts = [(job, idx, group)]
            for part in parts:
                master = masters.get(part[2], "")
                if master:
                    routes.setdefault(master, []).append(part)
                else:
                    stuck.append(part)
                    why = E.Unavailable(f"delay group {part[2]!r} has no live master now")
        return routes, stuck, why

    async def _route_immediate(self, pieces: list[_Piece]):
        """Immediate messages go to their subject's real-time groups, each to the group of its
        id's hash (``cluster/routes.py``), so a retry lands where the first try went; the
        messages of a group without a master now wait and are tried again."""
        routes: dict[str, list[_Piece]] = {}
        stuck: list[_Piece] = []
        why = None
        for job, idx, _ in pieces:
            if isinstance(job.subjects, str):
                by_subject = {job.subjects: idx}
            else:
                subs = [job.subjects[i] for i in idx.tolist()]
                by_subject = {s: idx[np.array([x == s for x in subs])] for s in dict.fromkeys(subs)}
            for subject, sidx in by_subject.items():
                view = await route_of(self.resolver, subject)
                if len(view.groups) == 1:
                    routes.setdefault(view.masters[0], []).append((job, sidx, None))
                    continue
                gi = view.targets([job.ids[i] for i in sidx.tolist()])
                for k in np.unique(gi).tolist():
                    part = (job, sidx[gi == k], None)
                    if view.masters[k]:
                        routes.setdefault(view.masters[k], []).append(part)
                    else:
                        stuck.append(part)
                        why = E.Unavailable(f"real-time group {view.groups[k]!r} of subject {subject!r} "
                                            f"has no live master now")
        return routes, stuck, why

    async def _send_to(self, address: str, pieces: list[_Piece], immediate: bool):
        try:
            batch, delay, order = _build(pieces, immediate=immediate)
        except E.InvalidArgument as err:
            self._fail(pieces, err)
            return [], None
        req = make_request(batch, delay_ms=delay, immediate=immediate)
        for job in {id(j): j for j, _, _ in pieces}.values():
            job.note(address)
        try:
            if len(req.batch) + len(req.delay_ms) <= STREAM_REQUEST_BYTES_MAX:
                resp = await self.channels.send_stream(address).call(req, timeout=self.timeout_s)
            else:
                resp = await self.channels.producer(address).SendBatch(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            if _too_large_for_grpc(e):  # the estimate is meant to prevent this; a retry cannot help
                self._fail(pieces, E.InvalidArgument("request", f"{batch.n} messages to {address}: {e.details()}"))
                return [], None
            err = status.from_rpc_error(e)
            if status.retryable(err):
                return pieces, E.Unavailable(f"{address}: {err}")
            self._fail(pieces, err)  # DiskFull too: as the node sent it, with its address and free space
            return [], None
        try:
            res = _unsorted(BatchResult.from_pb(resp, batch.n), order)
        except E.InvalidArgument as err:
            self._fail(pieces, E.HourglassError(f"malformed answer from {address}: {err}"))
            return [], None
        return self._answer(pieces, res)

    # ------------------------------------------------------------------ cancel / lookup

    async def _groups_for_id(self, msg_id: str) -> list[str]:
        """Masters to ask about an id: its own group's first, then every other group's (an id
        sent before the set of groups changed may live elsewhere)."""
        groups = await self._delay_groups()
        mine = group_for(msg_id, groups)
        ordered = [m for g, m in groups if g == mine] + [m for g, m in groups if g != mine]
        if not ordered[0]:
            raise E.Unavailable(f"delay group {mine!r} of id {msg_id!r} has no live master now")
        # a draining group last: its messages move to their home among the others (asked
        # first); one not moved yet is still there (docs/design.md, "Draining a delay group")
        draining = getattr(self.resolver, "draining_groups", lambda: [])()
        # "": a draining group without a master now (a failover): NotFound elsewhere is not the
        # answer yet (``_ask_once`` makes it Unavailable, retried)
        return [m for m in ordered if m] + [m for _, m in draining]

    async def _ask_groups(self, msg_id: str, method: str, request):
        """The first OK answer; an error other than NotFound from any group wins over NotFound.
        Unavailable is retried through discovery (``resolver.refresh()``) with backoff until
        ``retries_max`` retries or ``call_timeout_s``, then raised saying what was tried."""
        tried: dict[str, int] = {}
        attempts = 0
        last: BaseException | None = None
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                async for attempt in AsyncRetrying(stop=stop_after_attempt(self.retries_max + 1),
                                                   wait=_backoff(self.backoff_ms_min, self.backoff_ms_max),
                                                   retry=retry_if_exception(status.retryable), reraise=True):
                    with attempt:
                        attempts += 1
                        try:
                            return await self._ask_once(msg_id, method, request, tried)
                        except E.Unavailable as err:
                            if not status.retryable(err):
                                raise  # DiskFull: the caller gets it as it is
                            last = err
                            await self.resolver.refresh()
                            raise
        except TimeoutError:
            stopped = f"call_timeout_s={self.call_timeout_s} s"
        except E.DiskFull:
            raise
        except E.Unavailable:
            stopped = f"{self.retries_max} retries"
        asked = ", ".join(f"{a} (x{k})" for a, k in tried.items()) or "no node"
        raise E.Unavailable(f"{last or 'no answer'}; {method} of id {msg_id!r} gave up after {stopped} "
                            f"({attempts} attempts in {loop.time() - start:.1f} s, asked {asked})")

    async def _ask_once(self, msg_id: str, method: str, request, tried: dict[str, int]):
        not_found: BaseException | None = None
        for address in await self._groups_for_id(msg_id):
            if not address:  # asked every other group: the id may be in this one
                raise E.Unavailable(f"{method} of id {msg_id!r}: a draining delay group has no live master now")
            tried[address] = tried.get(address, 0) + 1
            resp = await self._call_node(address, method, request)
            if resp.code == pb.OK:
                return resp
            err = status.from_code(resp.code, resp.error)
            if not isinstance(err, E.NotFound):
                raise err
            not_found = err
        raise not_found or E.NotFound(msg_id)

    async def cancel(self, msg_id: str) -> CancelResult:
        """Cancel a scheduled message. NotFound for an unknown id, TooLate once dispatched.
        Asked of the id's group (and, for ids sent before the groups changed, the others).
        Returns or raises within ``call_timeout_s``."""
        resp = await self._ask_groups(msg_id, "Cancel", pb.CancelRequest(id=msg_id))
        return CancelResult(id=msg_id, seq=resp.seq)

    async def lookup(self, msg_id: str) -> LookupResult:
        """Where a message is (``pending`` ...); like ``cancel``, within ``call_timeout_s``."""
        resp = await self._ask_groups(msg_id, "Lookup", pb.LookupRequest(id=msg_id))
        return LookupResult(id=msg_id, status=resp.status, seq=resp.seq, deliver_at_ms=resp.deliver_at_ms,
                            subject=resp.subject, accepted_ms=resp.accepted_ms, effective_ms=resp.effective_ms,
                            cancelled_ms=resp.cancelled_ms, store_epoch=resp.store_epoch,
                            dispatched_ms=resp.dispatched_ms, dead_lettered=resp.dead_lettered,
                            realtime_group=resp.realtime_group, realtime_address=resp.realtime_address,
                            group=resp.group, node_id=resp.node_id, accepted_node_id=resp.accepted_node_id)

    async def trace(self, msg_id: str) -> MessageTrace:
        """A message's trace: ``lookup`` at its delay group, then, once dispatched, ``Consumer/Trace``
        at the real-time master the delay node names (``realtime_address``: its subject's route
        and its id, the rule it dispatches by), else at the route's groups, the id's own first
        (the route needs a produce or consume grant). A
        real-time answer that cannot be had is said in ``realtime_error``; the delay
        Lookup's own errors are raised (NotFound for an unknown id)."""
        lk = await self.lookup(msg_id)
        if lk.status != "dispatched" or lk.dead_lettered:
            return MessageTrace(lk)
        try:
            return MessageTrace(lk, await self._trace_realtime(lk))
        except E.HourglassError as e:
            return MessageTrace(lk, None, f"{type(e).__name__}: {e}")

    async def _trace_realtime(self, lk: LookupResult) -> RealtimeTrace:
        request = pb.TraceRequest(subject=lk.subject, id=lk.id, around_ms=lk.dispatched_ms)
        not_found: E.HourglassError | None = None
        tried: set[str] = set()
        # the master the delay node named (no route call: a cancel grant alone may trace) ...
        if lk.realtime_address:
            tried.add(lk.realtime_address)
            try:
                return await self._trace_at(lk.realtime_address, request)
            except (E.NotFound, E.UnknownSubject, E.Unavailable) as err:
                not_found = err
        # ... then the route's groups, the id's own first (a master changed, a route changed)
        view = await route_of(self.resolver, lk.subject)
        k = int(view.targets([lk.id])[0]) if len(view.groups) > 1 else 0
        masters = view.masters + view.draining_masters  # a draining group may hold it still
        for i in [k, *(j for j in range(len(masters)) if j != k)]:
            address = masters[i]
            if not address or address in tried:
                continue
            try:
                return await self._trace_at(address, request)
            except (E.NotFound, E.UnknownSubject) as err:
                not_found = not_found or err
        raise not_found or E.Unavailable(f"no real-time group of subject {lk.subject!r} has a master now")

    async def _trace_at(self, address: str, request) -> RealtimeTrace:
        try:
            r = await self.channels.consumer(address).Trace(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None
        return RealtimeTrace(r.node_id, r.group, r.position, r.seq, r.stored_ms, r.attempts, r.found_by,
                             [GroupTrace(g.group, g.state, g.copy_id, g.copy_subject, g.copy_ms) for g in r.groups])

    async def _call_node(self, address: str, method: str, request):
        try:
            return await getattr(self.channels.producer(address), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            err = status.from_rpc_error(e)
            if status.retryable(err) and not isinstance(err, E.NotLeader):
                raise E.Unavailable(f"{address}: {err}") from None
            raise err from None

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Wait up to ``timeout_s`` for the answers still due, then fail what is left with
        ``Closed`` and close the channels."""
        if self._closed:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeout_s):
                await self.flush()
        self._closed = True
        self._room.set()
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batcher
        sending = list(self._sending)
        for t in sending:
            t.cancel()
        await asyncio.gather(*sending, return_exceptions=True)
        for job in self._queue:
            if not job.sealed:
                job.seal()
        leftover = [(job, np.arange(job.taken, job.n), None) for job in self._queue]
        self._queue.clear()
        self._fail(leftover, E.Closed("producer closed"))
        await self.channels.close()


# ---------------------------------------------------------------------- consumer

NODE_OK = "ok"                    # ``NodeHealth.state``: the node's last pull answered
NODE_UNREACHABLE = "unreachable"  # ... failed (down, not the master, no answer in time): retried with backoff
HEALTH_ERROR_CHARS_MAX = 300      # ``NodeHealth.last_error`` is cut to this
RELEASE_STEP_MS = 2               # lookahead: held messages due within this of each other are handed out together
RELEASE_SLACK_S = 0.0005          # and the consumer wakes this long after the latest due time of a slice
ROUTES_RECHECK_S = 0.25           # a consumer asks its resolver for its subjects' routes at least this often


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """What a consumer knows of one real-time node it pulls from (``Consumer.health()``)."""

    address: str
    state: str          # NODE_OK or NODE_UNREACHABLE
    since_ms: int       # wall-clock ms when the node entered ``state``
    last_error: str     # the last failed pull's error ("" if none yet); kept once the node is back
    failures: int       # pulls failed in a row (0 while ok)


def _health_step(h: NodeHealth | None, address: str, error: BaseException | None,
                 now_ms: int) -> tuple[NodeHealth, bool]:
    """A node's health after one pull (``error`` None: it answered); and whether its state
    changed (a node seen for the first time changes only when it fails)."""
    if error is None:
        if h is not None and h.state == NODE_OK:
            return h, False
        return NodeHealth(address, NODE_OK, now_ms, h.last_error if h else "", 0), h is not None
    text = str(error)
    text = text if len(text) <= HEALTH_ERROR_CHARS_MAX else text[:HEALTH_ERROR_CHARS_MAX - 3] + "..."
    if h is not None and h.state == NODE_UNREACHABLE:
        return NodeHealth(address, NODE_UNREACHABLE, h.since_ms, text, h.failures + 1), False
    return NodeHealth(address, NODE_UNREACHABLE, now_ms, text, 1), True


class Received:
    """A delivered message. ``id`` is the id the producer gave (a retry after a nack travels
    as ``{id}~r{n}`` with the original in property ``hourglass.origin_id``; ``id`` shows the
    original, ``wire_id`` the one on the wire). ``node`` is the real-time node it came from."""

    __slots__ = ("id", "wire_id", "subject", "payload", "tags", "properties", "deliver_at_ms", "attempts",
                 "handle", "received_ms", "node", "_consumer")

    def __init__(self, wire_id: str, subject: str, payload: bytes, deliver_at_ms: int, attempts: int, handle: int,
                 received_ms: int, node: str, consumer: "Consumer") -> None:
        self.id = wire_id
        self.wire_id = wire_id
        self.subject = subject
        self.payload = payload
        self.tags: tuple[str, ...] = ()
        self.properties: dict[str, str] = {}
        self.deliver_at_ms = deliver_at_ms
        self.attempts = attempts
        self.handle = handle
        self.received_ms = received_ms
        self.node = node
        self._consumer = consumer

    @property
    def lateness_ms(self) -> int:
        return self.received_ms - self.deliver_at_ms

    async def ack(self) -> None:
        await self._consumer.ack([self])

    async def nack(self, retry_after_ms: int | None = None) -> None:
        await self._consumer.nack([self], retry_after_ms=retry_after_ms)

    def __repr__(self) -> str:
        return (f"Received(id={self.id!r}, subject={self.subject!r}, deliver_at_ms={self.deliver_at_ms}, "
                f"attempts={self.attempts}, handle={self.handle}, {len(self.payload)} bytes)")


class ReceivedBatch:
    """What one pull of one real-time node returned: the codec ``batch`` as it came, a
    handle per message and when it arrived. Per-message views are built only when read."""

    __slots__ = ("batch", "handles", "received_ms", "node", "_consumer", "_ids")

    def __init__(self, consumer: "Consumer", node: str, batch: Batch, handles: np.ndarray, received_ms: int) -> None:
        self.batch = batch
        self.handles = handles
        self.received_ms = received_ms
        self.node = node
        self._consumer = consumer
        self._ids: list[str] | None = None

    def __len__(self) -> int:
        return self.batch.n

    @property
    def wire_ids(self) -> list[str]:
        return self.batch.id_list()

    @property
    def ids(self) -> list[str]:
        """Original ids (``hourglass.origin_id`` where a retry carries one)."""
        if self._ids is None:
            ids = self.batch.id_list()
            for i, (_, props) in self._extras():
                origin = dict(props).get(ORIGIN_ID)
                if origin:
                    ids[i] = origin
            self._ids = ids
        return self._ids

    @property
    def payloads(self) -> list[bytes]:
        return self.batch.payload_list()

    @property
    def subjects(self) -> list[str]:
        return self.batch.subject_list()

    @property
    def deliver_at_ms(self) -> np.ndarray:
        return self.batch.deliver_at_ms

    @property
    def lateness_ms(self) -> np.ndarray:
        return self.received_ms - self.batch.deliver_at_ms

    def _extras(self):
        """(index, (tags, properties)) of each message that has extras."""
        b = self.batch
        if not b.extras:
            return []
        ends = b.extra_end.astype(np.int64)
        has = np.flatnonzero(np.diff(ends, prepend=0) > 0)
        return [(i, b.extra(i)) for i in has.tolist()]

    def messages(self) -> list[Received]:
        b = self.batch
        node, rms, c = self.node, self.received_ms, self._consumer
        out = [Received(w, s, p, d, a, h, rms, node, c) for w, s, p, d, a, h in
               zip(b.id_list(), b.subject_list(), b.payload_list(), b.deliver_at_ms.tolist(), b.attempts.tolist(),
                   self.handles.tolist())]
        for i, (tags, props) in self._extras():
            m = out[i]
            m.tags = tags
            m.properties = dict(props)
            m.id = m.properties.get(ORIGIN_ID, m.wire_id)
        return out

    def __iter__(self):
        return iter(self.messages())

    async def ack(self, *, wait: bool = False, defer: bool = False) -> int:
        """Ack every message of the batch (handle ranges per subject). Returns how many.

        By default the ack is pipelined (issue 28): it rides on the consumer's next pull of
        that node, which the next ``batches()`` step sends at once, or, when no pull goes
        there within ``ack_linger_ms`` (the consumer idles in a long poll), on an Ack call of
        its own then; the call returns at once and the next batch is not held back by a round
        trip and the node's fsync. An ack is durable at the node's next commit round; until
        then a crash may deliver the batch again (delivery is at least once; an ack that
        fails is logged and its messages come again after ``ack_timeout_ms``).
        ``wait=True``: one Ack request now, returning once the node made the ack durable
        (``Unavailable`` after ``call_timeout_s``). ``defer=True``: only on the next pull
        of that node (or at ``close()``), never a call of its own."""
        b = self.batch
        if not wait:  # queued as arrays: made into ranges once per request that carries them
            self._consumer._queue_acks(self.node, (b.subjects, b.subject_idx, self.handles), linger=not defer)
            return len(self.handles)
        async with self._consumer._deadline("ack", [self.node]):
            return await self._consumer._ack_handles(self.node, _subject_handles(b, self.handles))

    async def nack(self, retry_after_ms: int | None = None) -> tuple[int, int]:
        """Retry every message after ``retry_after_ms``; returns (retried, dead-lettered)."""
        async with self._consumer._deadline("nack", [self.node]):
            return await self._consumer._nack_handles(self.node, _subject_handles(self.batch, self.handles),
                                                      retry_after_ms)


def _subject_handles(batch: Batch, handles: np.ndarray) -> list[pb.SubjectHandles]:
    """The handles of a batch as ``[lo, hi)`` ranges per subject."""
    return _ranges_by_subject(batch.subjects, batch.subject_idx, handles)


def _ranges_by_subject(subjects: tuple[str, ...], subject_idx: np.ndarray,
                       handles: np.ndarray) -> list[pb.SubjectHandles]:
    """Handles as ``[lo, hi)`` ranges per subject (``subject_idx`` numbers ``subjects``;
    ``wire.pack_ranges`` for every subject at once: one sort by (subject, handle), ranges
    cut where either jumps)."""
    if len(subjects) == 1:
        return [pb.SubjectHandles(subject=subjects[0], ranges=pack_ranges(handles))]
    if len(handles) <= SMALL_RANGES_MAX:  # the same answer from a loop (a small batch: most pulls)
        by: dict[int, list[int]] = {}
        for s, h in zip(subject_idx.tolist(), handles.tolist()):
            by.setdefault(s, []).append(h)
        out = []
        for s in sorted(by):
            pairs = range_pairs(sorted(by[s]))
            out.append(pb.SubjectHandles(subject=subjects[s], ranges=struct.pack(f"<{len(pairs)}Q", *pairs)))
        return out
    sidx = subject_idx.astype(np.int64)
    order = np.lexsort((handles, sidx))
    h, s = handles[order].astype(np.int64), sidx[order]
    cut = np.flatnonzero((np.diff(h) != 1) | (np.diff(s) != 0)) + 1
    first = np.concatenate(([0], cut))
    last = np.concatenate((cut, [len(h)])) - 1
    pairs = np.column_stack((h[first], h[last] + 1)).astype("<u8")
    owner = s[first]
    bounds = np.flatnonzero(np.diff(owner)) + 1
    return [pb.SubjectHandles(subject=subjects[int(owner[a])], ranges=pairs[a:b].tobytes())
            for a, b in zip(np.concatenate(([0], bounds)).tolist(), np.concatenate((bounds, [len(owner)])).tolist())]


async def _first_done(tasks, timeout: float | None) -> None:
    """``asyncio.wait(tasks, timeout=timeout, return_when=FIRST_COMPLETED)`` without its
    result sets and its per-call checks of every argument (the iterators wait once per
    slice they hand out): returns once a task is done (one already done: on the loop's next
    turn, as ``asyncio.wait``) or ``timeout`` seconds passed."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_=None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for t in tasks:
        t.add_done_callback(wake)
    timer = loop.call_later(timeout, wake) if timeout is not None else None
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.remove_done_callback(wake)


# a pipelined ack as ``ReceivedBatch.ack`` queues it: the batch's subject table, its subject_idx, its handles
_QueuedAck = tuple[tuple[str, ...], np.ndarray, np.ndarray]


def _queued_ranges(queued: list[_QueuedAck]) -> list[pb.SubjectHandles]:
    """The acks queued for one node as ranges per subject, made once for the request that
    carries them: every batch's handles in one ``_ranges_by_subject`` (their subject tables
    merged; the batches of one pull share one), not a protobuf message per subject per batch."""
    if len(queued) == 1:
        return _ranges_by_subject(*queued[0])
    first = queued[0][0]
    handles = np.concatenate([h for _, _, h in queued])
    if all(t is first or t == first for t, _, _ in queued):
        return _ranges_by_subject(first, np.concatenate([i for _, i, _ in queued]), handles)
    number: dict[str, int] = {}
    idx = np.concatenate([np.array([number.setdefault(x, len(number)) for x in t], np.int64)[i.astype(np.int64)]
                          for t, i, _ in queued])
    return _ranges_by_subject(tuple(number), idx, handles)


class Consumer:
    def __init__(self, resolver, subjects: str | Sequence[str], *, group: str, consumer_id: str | None = None,
                 tags: Sequence[str] = (), batch_max: int = _CONSUMER.batch_max, wait_ms: int = _CONSUMER.wait_ms,
                 timeout_s: float = _CALLS.timeout_s, call_timeout_s: float = _CALLS.call_timeout_s,
                 backoff_ms_min: int = _CALLS.backoff_ms_min, backoff_ms_max: int = _CALLS.backoff_ms_max,
                 ack_linger_ms: int = _CONSUMER.ack_linger_ms, nack_retry_after_ms: int = _CONSUMER.nack_retry_after_ms,
                 lookahead_ms: int = _CONSUMER.lookahead_ms,
                 security: ClientSecurity | None = None) -> None:
        if not call_timeout_s > 0:
            raise E.InvalidArgument("call_timeout_s", "must be positive")
        if not 0 <= ack_linger_ms <= ACK_LINGER_MS_MAX:
            raise E.InvalidArgument("ack_linger_ms", f"{ack_linger_ms} is not in 0..{ACK_LINGER_MS_MAX}")
        self.resolver = resolver
        self.subjects = (subjects,) if isinstance(subjects, str) else tuple(subjects)
        if not self.subjects:
            raise E.InvalidArgument("subjects", "give at least one subject")
        for s in self.subjects:  # the one subject rule (codec.subject_problem), before any call
            check_subject(s)
        check_subject(group, "group")
        self.subject = self.subjects[0]
        self.group = group
        self.consumer_id = consumer_id or f"c-{secrets.token_hex(4)}"
        self.tags = tuple(tags)
        self.batch_max = batch_max
        self.wait_ms = wait_ms
        self.timeout_s = timeout_s            # one request (a pull: plus its wait_ms)
        self.call_timeout_s = call_timeout_s  # one call of pull / pull_batch (plus its wait_ms), ack, nack
        self.channels = Channels(security or getattr(resolver, "security", None))
        self._wait = _backoff(backoff_ms_min, backoff_ms_max)
        self._pulls: dict[str, asyncio.Task] = {}   # node -> its pull in flight
        self._failures: dict[str, int] = {}         # node -> failed pulls in a row
        self._route_failures = 0                    # rounds in a row without any node known
        self._health: dict[str, NodeHealth] = {}    # node -> what its last pulls said (``health()``)
        self._buffer: deque[Received] = deque()
        self._deferred: dict[str, list[_QueuedAck]] = {}  # node -> acks for its next pull
        self._routes_kept: tuple[float, object, dict[str, list[str]]] | None = None  # ``_routes``
        self.ack_linger_ms = ack_linger_ms
        self.nack_retry_after_ms = nack_retry_after_ms  # a nack that names no retry_after_ms
        self._ack_flushers: dict[str, asyncio.Task] = {}  # node -> the Ack call its queued acks get if no pull takes them
        self._ack_sends: set[asyncio.Task] = set()  # flushers past their linger, sending
        self.lookahead_ms = lookahead_ms
        self._held: list[tuple[int, int, ReceivedBatch]] = []  # (release ms, seq, batch): the iterators' lookahead
        self._held_seq = 0
        self._looked_ahead = False  # an iterator pulled with lookahead (``_flush_acks_later``)
        self._closed = False

    @classmethod
    def from_settings(cls, resolver, subjects: str | Sequence[str], settings: ClientSettings, *, group: str,
                      consumer_id: str | None = None, tags: Sequence[str] = (),
                      security: ClientSecurity | None = None) -> "Consumer":
        """A consumer with every value from ``settings`` (its ``calls`` and ``consumer``)."""
        return cls(resolver, subjects, group=group, consumer_id=consumer_id, tags=tags, **settings.calls.model_dump(),
                   **settings.consumer.model_dump(), security=security)

    async def __aenter__(self) -> "Consumer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ pulling

    async def _routes(self) -> dict[str, list[str]]:
        """node -> the subjects it serves now: every master of each subject's route (a subject
        spread over several real-time groups is pulled from all of them; each message is
        acked to the node it came from). A subject whose nodes are unknown is left out this
        round; none known at all raises Unavailable."""
        version = getattr(self.resolver, "routes_version", None)
        kept = self._routes_kept
        if kept is not None and version is not None and kept[1] == version \
                and time.monotonic() - kept[0] < ROUTES_RECHECK_S:
            return kept[2]
        routes: dict[str, list[str]] = {}
        last: E.Unavailable | None = None
        for s in self.subjects:
            try:
                for node in (await route_of(self.resolver, s)).live():
                    routes.setdefault(node, []).append(s)
            except E.Unavailable as err:
                last = err
        if not routes:
            self._routes_kept = None
            await self.resolver.refresh()
            raise last or E.Unavailable("no real-time node known")
        # kept while the resolver's routes stay as they were, and asked again every
        # ROUTES_RECHECK_S (a resolver's own refresh runs from these asks): one ask per
        # subject per round cost about a fifth of a consumer's CPU at small batches
        version = getattr(self.resolver, "routes_version", None)
        self._routes_kept = None if last is not None or version is None else (time.monotonic(), version, routes)
        return routes

    async def _pull_node(self, node: str, subjects: list[str], max_messages: int, wait_ms: int,
                         pause_s: float, lookahead_ms: int = 0) -> ReceivedBatch | None:
        if pause_s:
            await asyncio.sleep(pause_s)
        req = pb.PullRequest(group=self.group, consumer_id=self.consumer_id, max_messages=max_messages,
                             wait_ms=wait_ms, tags=self.tags, lookahead_ms=lookahead_ms)
        if len(subjects) == 1:
            req.subject = subjects[0]
        else:
            req.subjects.extend(subjects)
        acks = self._deferred.pop(node, None)
        if acks:
            req.acks.extend(_queued_ranges(acks))
        try:
            resp = await self.channels.pull_stream(node).call(req, timeout=self.timeout_s + wait_ms / 1000)
        except grpc.RpcError as e:
            if acks:  # not applied (or not known to be): keep them for the next call
                self._deferred.setdefault(node, [])[:0] = acks
            raise status.from_rpc_error(e) from None
        except asyncio.CancelledError:
            if acks:
                self._deferred.setdefault(node, [])[:0] = acks
            raise
        received_ms = _now_ms()
        if not resp.batch:
            return None
        batch = Batch.decode(resp.batch)
        handles = np.frombuffer(resp.handles, "<u8")
        if len(handles) != batch.n:
            raise E.InvalidArgument("pull response", f"{len(handles)} handles for {batch.n} messages")
        rb = ReceivedBatch(self, node, batch, handles, received_ms)
        if self.tags:
            rb = await self._keep_tagged(rb)
        return rb if len(rb) else None

    async def _keep_tagged(self, rb: ReceivedBatch) -> ReceivedBatch:
        """The exact tag check behind the server's hash filter: messages without one of our
        tags are acked away (only messages with extras can carry tags)."""
        want = set(self.tags)
        keep = np.zeros(len(rb), bool)
        for i, (tags, _) in rb._extras():
            keep[i] = not want.isdisjoint(tags)
        if keep.all():
            return rb
        drop = np.flatnonzero(~keep)
        await self._ack_handles(rb.node, _subject_handles(rb.batch.take(drop), rb.handles[drop]))
        kept = np.flatnonzero(keep)
        return ReceivedBatch(self, rb.node, rb.batch.take(kept), rb.handles[kept], rb.received_ms)

    def _start_pulls(self, routes: dict[str, list[str]], max_messages: int | None, wait_ms: int | None,
                     only: set[str] | None = None, lookahead_ms: int = 0) -> None:
        """A pull in flight for every node of ``routes`` (of ``only``) that has none."""
        loop = asyncio.get_running_loop()
        for node, subjects in routes.items():
            if node not in self._pulls and (only is None or node in only):
                failures = self._failures.get(node, 0)
                self._pulls[node] = loop.create_task(self._pull_node(
                    node, subjects, max_messages or self.batch_max, self.wait_ms if wait_ms is None else wait_ms,
                    _pause_s(self._wait, failures) if failures else 0.0, lookahead_ms))

    async def _round(self, max_messages: int | None, wait_ms: int | None, *,
                     prefetch: bool = False) -> tuple[list[ReceivedBatch], BaseException | None]:
        """Make sure every node serving our subjects has a pull in flight, wait for the
        first to answer and return every answer there is (and a node's error, if any).
        Pulls still waiting stay in flight for the next round. With ``prefetch`` (the
        iterators) a node that answered with messages gets its next pull at once, so it
        runs while the caller handles and acks this batch (an awaited ``batch.ack()`` does
        not hold the next batch back by its round trip and the node's fsync)."""
        if self._closed:
            raise E.Closed("consumer closed")
        routes = await self._routes()
        for gone in [n for n in self._health if n not in routes and n not in self._pulls]:
            del self._health[gone]  # its subjects moved to another node: it no longer concerns us
        lookahead = self.lookahead_ms if prefetch else 0
        self._looked_ahead = self._looked_ahead or bool(lookahead)
        self._start_pulls(routes, max_messages, wait_ms, lookahead_ms=lookahead)
        pending = {t: n for n, t in self._pulls.items()}
        timeout = None
        if self._held and lookahead:  # a held batch falls due: hand it out then, whatever the pulls do
            timeout = max(0.0, (self._held[0][0] - time.time() * 1000) / 1000) + RELEASE_SLACK_S
        await _first_done(pending, timeout)
        if self._closed:
            raise E.Closed("consumer closed")
        out: list[ReceivedBatch] = []
        err: BaseException | None = None
        for t, node in pending.items():
            if not t.done():
                continue
            if self._pulls.get(node) is t:
                del self._pulls[node]
            if t.cancelled():
                continue
            exc = t.exception()
            if exc is None:
                self._failures.pop(node, None)
                self._note_health(node, None, routes.get(node, ()))
                if t.result() is not None:
                    out.append(t.result())
            else:
                self._failures[node] = self._failures.get(node, 0) + 1
                if isinstance(exc, E.Unavailable):
                    if not isinstance(exc, E.Overloaded):  # overloaded: it answered, and says wait
                        self._note_health(node, exc, routes.get(node, ()))
                    await self.resolver.refresh()
                err = exc
        if prefetch and out and not self._closed:
            self._start_pulls(routes, max_messages, wait_ms, only={rb.node for rb in out}, lookahead_ms=lookahead)
        if lookahead:
            out = self._hold(out)
        return out, err

    def _hold(self, out: list[ReceivedBatch]) -> list[ReceivedBatch]:
        """Lookahead (``lookahead_ms``): the part of each batch that is due now, and the rest
        held until due (``_held``), in slices of messages due within ``RELEASE_STEP_MS`` of each
        other, each handed out at the latest due time in it (never before any message's due
        time, by this process's clock, nor held past ``lookahead_ms`` after it arrived: a node
        hands a message out early only when it was stored further ahead than its hold limit,
        as without lookahead); then every held slice that is due."""
        now = _now_ms()
        ready = []
        for rb in out:
            due = np.minimum(rb.batch.deliver_at_ms.astype(np.int64), rb.received_ms + self.lookahead_ms)
            if not len(due) or int(due.max()) <= now:
                ready.append(rb)
                continue
            step = -(-np.maximum(due, now) // RELEASE_STEP_MS)  # the step each message is handed out in
            if bool((step[1:] >= step[:-1]).all()):  # in step order already (a stable sort keeps it)
                batch, handles, s, d = rb.batch, rb.handles, step, due
            else:  # one gather into step order; each slice is then a contiguous run (views, no copy)
                order = np.argsort(step, kind="stable")
                batch, handles, s, d = rb.batch.take(order), rb.handles[order], step[order], due[order]
            starts = np.flatnonzero(np.diff(s)) + 1
            ends = np.append(starts, len(s)).tolist()
            starts = np.insert(starts, 0, 0)
            ats = np.maximum.reduceat(d, starts).tolist()  # the latest due time of each slice
            for a, b, at in zip(starts.tolist(), ends, ats):
                piece = rb if b - a == len(rb) else ReceivedBatch(self, rb.node, batch.take(slice(a, b)),
                                                                  handles[a:b], rb.received_ms)
                if at <= now:
                    ready.append(piece)
                else:
                    self._held_seq += 1
                    heapq.heappush(self._held, (at, self._held_seq, piece))
        while self._held and self._held[0][0] <= now:
            ready.append(heapq.heappop(self._held)[2])
        for rb in ready:
            rb.received_ms = now
        return ready

    def _note_health(self, node: str, error: BaseException | None, subjects) -> None:
        """Record one pull's outcome; a change of state is logged once (not once per retry)."""
        h, changed = _health_step(self._health.get(node), node, error, _now_ms())
        before = self._health.get(node)
        self._health[node] = h
        if not changed:
            return
        if h.state == NODE_UNREACHABLE:
            log.warning("real-time node unreachable node=%s subjects=%s group=%s: %s (retrying with backoff "
                        "until it is back)", node, ",".join(subjects), self.group, h.last_error)
        else:
            log.info("real-time node back node=%s subjects=%s group=%s unreachable_ms=%d failed_pulls=%d", node,
                     ",".join(subjects), self.group, h.since_ms - before.since_ms, before.failures)

    def health(self) -> dict[str, NodeHealth]:
        """Per real-time node this consumer pulls from (address -> ``NodeHealth``): ``ok`` or
        ``unreachable`` since when, and the last error. A node is listed from its first
        answer or failure on, until its subjects move to another node."""
        return dict(sorted(self._health.items()))

    async def pull_batch(self, max_messages: int | None = None, wait_ms: int | None = None) -> list[ReceivedBatch]:
        """One long-poll round over every node serving our subjects: the batches that
        arrived (one per node that answered; empty when nothing came within ``wait_ms``).
        A node's error is raised when no node brought messages."""
        wait_s = (self.wait_ms if wait_ms is None else wait_ms) / 1000
        try:
            async with asyncio.timeout(self.call_timeout_s + wait_s):
                out, err = await self._round(max_messages, wait_ms)
        except TimeoutError:  # the pulls stay in flight for the next call
            raise E.Unavailable(f"pull of {','.join(self.subjects)}: no answer within call_timeout_s="
                                f"{self.call_timeout_s} s + wait_ms from {','.join(self._pulls) or 'no node'} "
                                f"({_describe(self.resolver)})") from None
        if err is not None and not out:
            raise err
        return out

    async def browse(self, max_messages: int | None = None, from_position: int = 0) -> BrowsePage:
        """Read the consumer's one subject without consuming it: what this group has not acked
        (in flight or never handed out), from ``from_position`` on (``Consumer/Browse``). The
        messages are not handed out: acking or nacking them does nothing. Within
        ``timeout_s``; errors as ``pull``'s."""
        if len(self.subjects) != 1:
            raise E.InvalidArgument("subjects", "browse reads one subject")
        node = await self.resolver.realtime_for(self.subject)
        req = pb.BrowseRequest(subject=self.subject, group=self.group, from_position=from_position,
                               max_messages=max_messages or self.batch_max)
        try:
            resp = await self.channels.consumer(node).Browse(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None
        messages: list[Received] = []
        if resp.batch:
            batch = Batch.decode(resp.batch)
            positions = np.frombuffer(resp.positions, "<u8")
            if len(positions) != batch.n:
                raise E.InvalidArgument("browse response", f"{len(positions)} positions for {batch.n} messages")
            messages = ReceivedBatch(self, node, batch, positions, _now_ms()).messages()
        return BrowsePage(messages, resp.next_position, resp.end_position)

    async def pull(self, max_messages: int | None = None, wait_ms: int | None = None) -> list[Received]:
        """``pull_batch`` as ``Received`` messages."""
        return [m for rb in await self.pull_batch(max_messages, wait_ms) for m in rb.messages()]

    async def _next_batches(self) -> list[ReceivedBatch] | None:
        """One round for the iterators: None once closed. A failing node is retried with
        backoff (``_round``); an error that retrying cannot fix (bad request) is raised."""
        try:
            out, err = await self._round(None, None, prefetch=True)
        except E.Closed:
            return None
        except E.Unavailable as e:  # no node known for any subject
            self._route_failures += 1
            if self._route_failures == 1:  # said once, not once per retry
                log.warning("no real-time node for subjects=%s: %s (asking discovery again with backoff)",
                            ",".join(self.subjects), e)
            await asyncio.sleep(_pause_s(self._wait, self._route_failures))
            return []
        if self._route_failures:
            log.info("real-time nodes found again for subjects=%s after %d rounds", ",".join(self.subjects),
                     self._route_failures)
        self._route_failures = 0
        if err is not None and not isinstance(err, E.Unavailable):
            raise err
        return out

    async def batches(self) -> AsyncIterator[ReceivedBatch]:
        """Batches as they fall due, until ``close()``: what arrives due now at once, what a
        lookahead pull (``lookahead_ms``) brought ahead at its due time (``_hold``)."""
        while (out := await self._next_batches()) is not None:
            for rb in out:
                yield rb

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Received]:
        """Messages one by one, until ``close()``; a break keeps the rest of the batch for
        the next loop."""
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            out = await self._next_batches()
            if out is None:
                return
            for rb in out:
                self._buffer.extend(rb.messages())

    async def run(self, handler: Callable[[Received], Awaitable[None]], *, stop: asyncio.Event,
                  retry_after_ms: int | None = None) -> None:
        """Callback runner: ack after the handler returns, nack (retry later) if it raises."""
        if retry_after_ms is None:
            retry_after_ms = self.nack_retry_after_ms
        while not stop.is_set() and not self._closed:
            try:
                batch = await self.pull()
            except E.Closed:
                return
            except E.Unavailable:
                await asyncio.sleep(_pause_s(self._wait, 1))
                continue
            done, failed = [], []
            for msg in batch:
                try:
                    await handler(msg)
                    done.append(msg)
                except Exception:
                    log.exception("handler failed id=%s; retry in %d ms", msg.id, retry_after_ms)
                    failed.append(msg)
            await self.ack(done)
            if failed:
                await self.nack(failed, retry_after_ms=retry_after_ms)

    # ------------------------------------------------------------------ ack / nack

    @staticmethod
    def _by_node(msgs: Sequence[Received]) -> dict[str, list[pb.SubjectHandles]]:
        groups: dict[str, dict[str, list[int]]] = {}
        for m in msgs:
            groups.setdefault(m.node, {}).setdefault(m.subject, []).append(m.handle)
        return {node: [pb.SubjectHandles(subject=s, ranges=pack_ranges(h)) for s, h in subs.items()]
                for node, subs in groups.items()}

    def _queue_acks(self, node: str, ack: _QueuedAck, *, linger: bool) -> None:
        """Pipelined acks (``ReceivedBatch.ack``): for the next pull of ``node``; with
        ``linger``, an Ack call of their own after ``ack_linger_ms`` if no pull took them."""
        self._deferred.setdefault(node, []).append(ack)
        if linger and not self._closed and node not in self._ack_flushers:
            self._ack_flushers[node] = asyncio.get_running_loop().create_task(
                self._flush_acks_later(node), name=f"ack-linger-{node}")

    async def _flush_acks_later(self, node: str) -> None:
        # with lookahead the iterators' pulls answer about once per lookahead, not per batch:
        # the acks wait that much longer for one to ride on before they get a call of their own
        linger_ms = self.ack_linger_ms + (self.lookahead_ms if self._looked_ahead else 0)
        try:
            await asyncio.sleep(linger_ms / 1000)
        finally:
            self._ack_flushers.pop(node, None)  # acks queued from now on get a flusher of their own
        acks = self._deferred.pop(node, None)
        if not acks:
            return  # a pull took them
        task = asyncio.current_task()
        self._ack_sends.add(task)
        try:
            async with self._deadline("ack", [node]):
                await self._ack_handles(node, _queued_ranges(acks))
        except E.HourglassError as e:
            log.warning("pipelined acks not applied node=%s: %s (their messages come again after "
                        "ack_timeout_ms)", node, e)
        finally:
            self._ack_sends.discard(task)

    async def _ack_handles(self, node: str, acks: list[pb.SubjectHandles]) -> int:
        try:
            resp = await self.channels.consumer(node).Ack(pb.AckRequest(group=self.group, acks=acks),
                                                          timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None
        return resp.acked

    async def _nack_handles(self, node: str, nacks: list[pb.SubjectHandles],
                            retry_after_ms: int | None) -> tuple[int, int]:
        if retry_after_ms is None:
            retry_after_ms = self.nack_retry_after_ms
        req = pb.NackRequest(group=self.group, retry_after_ms=retry_after_ms, nacks=nacks)
        try:
            resp = await self.channels.consumer(node).Nack(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None
        return resp.retried, resp.dead_lettered

    async def ack(self, msgs: Sequence[Received]) -> int:
        """Ack messages (any nodes and subjects; one request per node). Returns how many the nodes
        acked; ``Unavailable`` after ``call_timeout_s``."""
        acked = 0
        by_node = self._by_node(msgs)
        async with self._deadline("ack", by_node):
            for node, acks in by_node.items():
                acked += await self._ack_handles(node, acks)
        return acked

    async def nack(self, msgs: Sequence[Received], *, retry_after_ms: int | None = None) -> None:
        by_node = self._by_node(msgs)
        async with self._deadline("nack", by_node):
            for node, nacks in by_node.items():
                await self._nack_handles(node, nacks, retry_after_ms)

    @contextlib.asynccontextmanager
    async def _deadline(self, what: str, nodes):
        try:
            async with asyncio.timeout(self.call_timeout_s):
                yield
        except TimeoutError:
            raise E.Unavailable(f"{what}: no answer within call_timeout_s={self.call_timeout_s} s "
                                f"from {','.join(nodes)}") from None

    async def close(self) -> None:
        """Stop: cancel the pulls in flight (no long poll is waited out), close channels."""
        self._closed = True
        pulls = list(self._pulls.values())
        self._pulls.clear()
        for t in pulls:
            t.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        # pipelined acks: a flush still waiting out its linger is cancelled (its acks are still
        # queued: sent below); one already sending is waited for (bounded by call_timeout_s)
        flushers = list(self._ack_flushers.values())
        for t in flushers:
            t.cancel()
        await asyncio.gather(*flushers, *self._ack_sends, return_exceptions=True)
        deferred, self._deferred = self._deferred, {}
        for node, acks in deferred.items():  # acks still waiting for a pull: send them now
            try:
                await self._ack_handles(node, _queued_ranges(acks))
            except E.HourglassError as e:
                log.warning("deferred acks not sent node=%s: %s (their messages come again)", node, e)
        await self.channels.close()
