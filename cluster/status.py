"""The one table between domain errors, protocol ``Code`` values and gRPC status codes.

Per-message results (SendBatch statuses, Cancel, Lookup) carry a ``Code``;
whole-call failures are gRPC statuses. Servicers and clients never choose codes
themselves: they call these functions.
"""

from __future__ import annotations

import json
import re

import grpc

from cluster import errors as E
from cluster.proto import hourglass_pb2 as pb

# domain error class -> (protocol Code, gRPC status); most specific first
TABLE: list[tuple[type[Exception], int, grpc.StatusCode]] = [
    (E.PayloadTooLarge, pb.PAYLOAD_TOO_LARGE, grpc.StatusCode.INVALID_ARGUMENT),
    (E.UnknownSubject, pb.UNKNOWN_SUBJECT, grpc.StatusCode.NOT_FOUND),
    (E.InvalidArgument, pb.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    (E.AlreadyExists, pb.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
    (E.NotFound, pb.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
    (E.TooLate, pb.TOO_LATE, grpc.StatusCode.FAILED_PRECONDITION),
    (E.NotLeader, pb.NOT_LEADER, grpc.StatusCode.UNAVAILABLE),
    (E.ReplicationTimeout, pb.REPLICATION_TIMEOUT, grpc.StatusCode.DEADLINE_EXCEEDED),
    (E.DiskFull, pb.OVERLOADED, grpc.StatusCode.RESOURCE_EXHAUSTED),  # message starts DISK_FULL_PREFIX
    (E.QuotaExceeded, pb.OVERLOADED, grpc.StatusCode.RESOURCE_EXHAUSTED),  # message starts QUOTA_PREFIX
    (E.Overloaded, pb.OVERLOADED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.RouteMoved, pb.OVERLOADED, grpc.StatusCode.UNAVAILABLE),  # message starts ROUTE_MOVED_PREFIX
    (E.StaleEpoch, pb.NOT_LEADER, grpc.StatusCode.FAILED_PRECONDITION),
    (E.Unavailable, pb.OVERLOADED, grpc.StatusCode.UNAVAILABLE),
    (E.OffsetOutOfRange, pb.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE),
    (E.Unauthenticated, pb.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED),
    (E.PermissionDenied, pb.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED),
]

# codes a client may retry (possibly elsewhere); everything else is final. An OVERLOADED whose
# message starts DISK_FULL_PREFIX is a DiskFull, final for the SDK too (``retryable``)
RETRYABLE_CODES = {pb.OVERLOADED, pb.NOT_LEADER, pb.REPLICATION_TIMEOUT, pb.INTERNAL}
DISK_FULL_PREFIX = "disk full"
QUOTA_PREFIX = "quota exceeded"  # a QuotaExceeded's text: final for the SDK, as a full disk
# a RouteMoved's text: retryable (an SDK from before it retries and refreshes its routes as for
# any OVERLOADED); a writer that knows it refreshes the subject's route at once
ROUTE_MOVED_PREFIX = "route moved"
# "node ADDRESS has N bytes ..." in a DiskFull's text (node/store/diskspace.py, ``Refusal.text``):
# a per-message answer carries only the text, the attributes are read back from it
_DISK_FULL_WHERE = re.compile(r"node (\S+) has (\d+) bytes")


def retryable(exc: BaseException) -> bool:
    """Whether the SDK retries ``exc`` within a call: ``Unavailable`` and its kinds (not the
    master, overloaded, a sync timeout, a node down), but not ``DiskFull``. A full disk comes
    back when retention or an operator frees space, not within the seconds a call waits, and
    retrying would only hide it behind a deadline ``Unavailable``: the caller gets it at once."""
    return isinstance(exc, E.Unavailable) and not isinstance(exc, (E.DiskFull, E.QuotaExceeded))


def final_refusal(message: str) -> bool:
    """An OVERLOADED per-message answer that is final all the same (``retryable``): a full
    disk or a quota, told by the start of its text."""
    return message.startswith((DISK_FULL_PREFIX, QUOTA_PREFIX))


def disk_full(message: str) -> E.DiskFull:
    """The ``DiskFull`` of a refusal's text (a per-message code, or a status without metadata)."""
    m = _DISK_FULL_WHERE.search(message)
    return E.DiskFull(message, m.group(1), int(m.group(2))) if m else E.DiskFull(message)


def to_code(exc: BaseException) -> int:
    for cls, code, _ in TABLE:
        if isinstance(exc, cls):
            return code
    return pb.INTERNAL


def to_grpc(exc: BaseException) -> grpc.StatusCode:
    for cls, _, status in TABLE:
        if isinstance(exc, cls):
            return status
    return grpc.StatusCode.INTERNAL


def from_code(code: int, message: str, *, leader_hint: str | None = None) -> E.HourglassError:
    """Rebuild the domain error a per-message ``Code`` stands for (client side)."""
    if code == pb.PAYLOAD_TOO_LARGE:
        return E.PayloadTooLarge("payload", message)
    if code == pb.UNKNOWN_SUBJECT:
        err = E.UnknownSubject(message)
        return err
    if code == pb.INVALID_ARGUMENT:
        return E.InvalidArgument("request", message)
    if code == pb.ALREADY_EXISTS:
        return E.AlreadyExists(message)
    if code == pb.NOT_FOUND:
        return E.NotFound(message)
    if code == pb.TOO_LATE:
        return E.TooLate(message)
    if code == pb.NOT_LEADER:
        return E.NotLeader(leader_hint)
    if code == pb.REPLICATION_TIMEOUT:
        return E.ReplicationTimeout(message)
    if code == pb.OVERLOADED:
        if message.startswith(QUOTA_PREFIX):
            return E.QuotaExceeded(message)
        if message.startswith(ROUTE_MOVED_PREFIX):
            return E.RouteMoved(message)
        return disk_full(message) if message.startswith(DISK_FULL_PREFIX) else E.Overloaded(message)
    return E.HourglassError(message or f"code {code}")


_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of its number (an ordered stream's ``refused.code``)."""
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


# trailing metadata of a failed call: the domain error's class and constructor arguments
ERROR_KEY = "hourglass-error"
ERROR_ARGS_KEY = "hourglass-error-args"
ERROR_ARGS_BYTES_MAX = 4096  # longer arguments are not sent (the status detail still says it all)


def _error_classes() -> dict[str, type[E.HourglassError]]:
    out, todo = {}, [E.HourglassError]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


def to_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What travels with the status so that the client rebuilds exactly this error."""
    if not isinstance(exc, E.HourglassError):
        return ()
    try:
        args = json.dumps(exc.wire_args())
    except (TypeError, ValueError):
        return ((ERROR_KEY, type(exc).__name__),)
    if len(args) > ERROR_ARGS_BYTES_MAX:
        return ((ERROR_KEY, type(exc).__name__),)
    return (ERROR_KEY, type(exc).__name__), (ERROR_ARGS_KEY, args)


async def abort(context, exc: BaseException) -> None:
    """End a call with ``exc``: its status from the table, its text, and its class and
    arguments for the client (``from_rpc_error``)."""
    await context.abort(to_grpc(exc), str(exc), trailing_metadata=to_metadata(exc))


def from_metadata(metadata, detail: str) -> E.HourglassError | None:
    """The error a server sent (``to_metadata``), or None when the call carries none (not an
    Hourglass server's answer, or a transport failure)."""
    md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    cls = _error_classes().get(md.get(ERROR_KEY, ""))
    if cls is None:
        return None
    try:
        args = json.loads(md[ERROR_ARGS_KEY]) if ERROR_ARGS_KEY in md else [detail]
        if not isinstance(args, list):
            raise ValueError("not a list")
        return cls(*args)
    except (TypeError, ValueError, KeyError):  # another version's arguments: keep the class, lose nothing said
        err = cls.__new__(cls, detail)
        Exception.__init__(err, detail)
        return err


def from_rpc_error(err: grpc.RpcError) -> E.HourglassError:
    """Map a failed call to a domain error (client side): the one the server sent, or one
    from the status when the call carries none."""
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    md = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return from_metadata(md, detail or "") or from_status(status, detail)


# connection failures that mean "TLS on one end, not on the other" (docs/security.md): what grpc
# says, and what a user should read
TLS_MISMATCH = [
    ("socket closed", "the server may require TLS: give a client certificate and token "
                      "(HOURGLASS_TLS_*, HOURGLASS_TOKEN_FILE, or the cluster file of `dev up --secure`)"),
    ("ssl", "the TLS handshake failed: the server may speak plaintext, or not trust this certificate's CA"),
    ("handshake", "the TLS handshake failed: the server may speak plaintext, or not trust this certificate's CA"),
]


def tls_note(detail: str) -> str:
    low = detail.lower()
    for needle, note in TLS_MISMATCH:
        if needle in low:
            return f" ({note}; docs/security.md)"
    return ""


def from_status(status: grpc.StatusCode, detail: str | None) -> E.HourglassError:
    """Map a gRPC status and its details to a domain error (client side), for a call that
    carries no error of its own (``from_metadata``): a transport failure, a deadline, an
    older server."""
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        return E.InvalidArgument("request", detail or "")
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return E.Unauthenticated(detail or "unauthenticated")
    if status == grpc.StatusCode.PERMISSION_DENIED:
        return E.PermissionDenied(detail or "permission denied")
    if status == grpc.StatusCode.NOT_FOUND:
        return E.NotFound(detail or "")
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if detail and detail.startswith(DISK_FULL_PREFIX):
            return disk_full(detail)
        if detail and detail.startswith(QUOTA_PREFIX):
            return E.QuotaExceeded(detail)
        return E.Overloaded(detail or "")
    if status == grpc.StatusCode.FAILED_PRECONDITION and detail and detail.startswith("stale epoch"):
        return E.StaleEpoch(0, 0)
    if status == grpc.StatusCode.DEADLINE_EXCEEDED and detail and "ack_mode=sync" in detail:
        return E.ReplicationTimeout(detail)  # the server's own sync-mode answer, not a client deadline
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        if detail and detail.startswith("not the master"):
            hint = detail.split("leader_hint=", 1)[-1] if "leader_hint=" in detail else None
            return E.NotLeader(None if hint in (None, "unknown") else hint)
        return E.Unavailable(f"{status.name}: {detail}{tls_note(detail or '')}")
    return E.HourglassError(f"{status.name}: {detail}")
