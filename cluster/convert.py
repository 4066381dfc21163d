"""Protobuf <-> domain conversion, used by servicers and the client alike."""

from __future__ import annotations

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
