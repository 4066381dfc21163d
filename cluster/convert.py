"""Protobuf <-> domain conversion, used by servicers and the client alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cluster.errors import InvalidArgument
from cluster.proto import hourglass_pb2 as pb
from node.store.records import Message


def message_from_pb(m: pb.Message, *, now_ms: int, immediate: bool = False) -> Message:
    """A producer's message as a domain Message (seq and store time are the node's to set)."""
    if m.deliver_at_ms and m.delay_ms:
        raise InvalidArgument("deliver_at_ms", "give deliver_at_ms or delay_ms, not both")
    if m.delay_ms < 0:
        raise InvalidArgument("delay_ms", "must not be negative")
    if immediate:
        due = m.deliver_at_ms or now_ms  # keep the original due time for lateness
    else:
        due = m.deliver_at_ms if m.deliver_at_ms else now_ms + m.delay_ms
    return Message(seq=0, store_ms=now_ms, deliver_at_ms=due, msg_id=m.id, subject=m.subject,
                   payload=m.payload, tags=tuple(m.tags), properties=tuple(sorted(m.properties.items())),
                   attempts=m.attempts)


def message_to_pb(m: Message) -> pb.Message:
    return pb.Message(id=m.msg_id, subject=m.subject, tags=list(m.tags), properties=dict(m.properties),
                      payload=m.payload, deliver_at_ms=m.deliver_at_ms, attempts=m.attempts)


def batch_from_pb(messages: Iterable[pb.Message], *, now_ms: int, immediate: bool,
                  check: Callable[[pb.Message], None] | None = None) -> list[Message | InvalidArgument]:
    """One entry per message of a SendBatch: the domain Message, or the InvalidArgument that
    refuses it (``check`` may refuse more). A bad message never fails the others."""
    out: list[Message | InvalidArgument] = []
    for m in messages:
        try:
            if check is not None:
                check(m)
            out.append(message_from_pb(m, now_ms=now_ms, immediate=immediate))
        except InvalidArgument as e:
            out.append(e)
    return out


def merge_results(converted: list, stored: list) -> list:
    """Put the store's results (one per converted Message, in order) back among the refusals."""
    results = iter(stored)
    return [c if isinstance(c, Exception) else next(results) for c in converted]
