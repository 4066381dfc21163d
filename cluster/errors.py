"""One error hierarchy for all of Hourglass.

Errors are named by what the caller should do about them:

* ``InvalidArgument`` and its children: the request is wrong; fix it, do not retry.
* ``NotFound`` / ``TooLate``: the answer to a cancel or lookup; nothing to retry.
* ``Unavailable`` and its children (``NotLeader``, ``Overloaded``, ``ReplicationTimeout``):
  try again later, possibly elsewhere.
* ``StorageError`` and its children: a file on disk is broken; an operator must look.
  These name the file and the byte offset.

The mapping of these errors to gRPC status codes lives in one table
(``cluster.status``), so servicers never pick status codes themselves. The table works both
ways: a server's error travels with its class name and constructor arguments
(``wire_args``), and the client rebuilds the same error (``cluster.status.from_rpc_error``).
"""

from __future__ import annotations


class HourglassError(Exception):
    """Base class of every error Hourglass raises on purpose. Remembers the arguments it
    was made with (``wire_args``): what a server sends so that a client can make the same
    error again."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls, *args)
        self._wire_args = list(args) + list(kwargs.values())
        return self

    def wire_args(self) -> list:
        return list(getattr(self, "_wire_args", [str(self)]))

    def __reduce__(self):
        # pickled (a worker process, a thread pool's future) as made: cls(*its arguments), not
        # cls(its message), which the errors with their own __init__ do not take
        return type(self), tuple(self.wire_args()), self.__dict__


# --- the caller's request is wrong -------------------------------------------------


class InvalidArgument(HourglassError):
    """A request or record is malformed; nothing was changed."""

    def __init__(self, field: str, reason: str) -> None:
        # a reason that already names the field (a server's "payload: ..." rebuilt by a
        # client, an error's text wrapped again) says it once: "invalid payload: 5 bytes ..."
        for said in (f"invalid {field}: ", f"{field}: "):
            if reason.startswith(said):
                reason = reason[len(said):]
                break
        super().__init__(f"invalid {field}: {reason}")
        self.field = field
        self.reason = reason


class PayloadTooLarge(InvalidArgument):
    pass


class UnknownSubject(InvalidArgument):
    def __init__(self, subject: str) -> None:
        super().__init__("subject", f"unknown subject {subject!r}")
        self.subject = subject


# --- answers to cancel / lookup ---------------------------------------------------


class NotFound(HourglassError):
    """No message with that id is known."""


class TooLate(HourglassError):
    """The message was already dispatched; it can no longer be cancelled."""


class AlreadyExists(HourglassError):
    """A message with this id exists with different content."""


# --- the caller is not allowed ------------------------------------------------------


class Unauthenticated(HourglassError):
    """The call carried no credentials the server accepts (no client certificate, no token,
    or an unknown one). Nothing was done; fix the credentials, do not retry."""


class PermissionDenied(HourglassError):
    """The caller is known but may not do this (this subject, group or method). Nothing was
    done; do not retry."""


# --- try again, maybe elsewhere ---------------------------------------------------


class Unavailable(HourglassError):
    """The server cannot serve this now; retry with backoff."""


class NotLeader(Unavailable):
    """This node is not the master of its group; retry at ``leader_hint``."""

    def __init__(self, leader_hint: str | None = None) -> None:
        super().__init__(f"not the master; leader_hint={leader_hint or 'unknown'}")
        self.leader_hint = leader_hint


class RouteMoved(Unavailable):
    """This real-time group no longer takes the subject: a narrowing dropped it from the
    subject's route (it drains, docs/design.md "Narrowing drains first"). Nothing of the
    refused messages was stored here; refresh the route and send them to the group it names
    now (the SDK and the delay nodes do)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail if detail.startswith("route moved") else f"route moved: {detail}")


class StaleEpoch(HourglassError):
    """A request carried an epoch older than the current term (fencing)."""

    def __init__(self, got: int, current: int) -> None:
        super().__init__(f"stale epoch {got}, current epoch is {current}")
        self.got = got
        self.current = current


class Overloaded(Unavailable):
    """A bounded queue is full; retry after a pause."""


class DiskFull(Overloaded):
    """The node's free disk space is at its watermark (``disk_free_min_bytes`` /
    ``disk_free_min_ratio``), the write would cross it, or a write hit ``ENOSPC``: writes are
    refused, nothing of the refused request was acknowledged; reads, dispatch and retention go
    on, and the node takes writes again by itself once space comes back (with a margin).

    ``node`` (its address) and ``free_bytes`` (-1: not known) say where an operator must free
    space. A kind of ``Overloaded`` (retrying later is right), but the SDK does not retry it
    within a call: space comes back when retention or an operator frees it, not in the
    seconds a call waits, so the caller gets it at once (docs/api.md, "Errors")."""

    def __init__(self, detail: str, node: str = "", free_bytes: int = -1) -> None:
        super().__init__(detail if detail.startswith("disk full") else f"disk full: {detail}")
        self.node = node
        self.free_bytes = free_bytes
        self._wire_args = [detail, node, free_bytes]  # as made, whichever were given by name


class QuotaExceeded(Overloaded):
    """A principal (a token's name; ``anonymous`` on an open cluster) reached one of its
    subject quotas: ``limit`` names the setting (``subjects_new_per_minute_max`` or
    ``subjects_owned_max``, docs/security.md "Subject quotas"). Nothing of the refused
    messages was stored. A kind of ``Overloaded`` (RESOURCE_EXHAUSTED), but the SDK does not
    retry it within a call: the caller decides (wait for the minute, or ask for a larger
    quota)."""

    def __init__(self, detail: str, limit: str = "", principal: str = "") -> None:
        super().__init__(detail if detail.startswith("quota exceeded") else f"quota exceeded: {detail}")
        self.limit = limit
        self.principal = principal
        self._wire_args = [detail, limit, principal]


class ReplicationTimeout(Unavailable):
    """Sync ack mode: no slave confirmed the bytes in time. The write is not acknowledged."""


class Closed(Unavailable):
    """The component is shutting down."""


# --- a server cannot start -------------------------------------------------------


class CannotListen(HourglassError):
    """A server could not bind its address: the port is taken, or the host is not an address
    of this machine. Nothing was started."""


# --- disk state is broken ---------------------------------------------------------


class StorageError(HourglassError):
    pass


class CorruptRecord(StorageError):
    """A record failed its checks somewhere other than a torn tail."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"corrupt record in {path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class OffsetOutOfRange(StorageError):
    """A read asked for an offset outside [start, end) or not on a record boundary."""

    def __init__(self, offset: int, start: int, end: int, reason: str = "") -> None:
        msg = f"offset {offset} out of range [{start}, {end})"
        super().__init__(msg + (f": {reason}" if reason else ""))
        self.offset = offset
        self.start = start
        self.end = end
