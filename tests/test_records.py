"""Record codec: round trips, strict decoding, producer limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.errors import InvalidArgument, PayloadTooLarge
from node.store import records
from node.store.records import Dispatched, Limits, Message

text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
messages = st.builds(
    Message,
    seq=st.integers(0, 2**64 - 1),
    store_ms=st.integers(-(2**63), 2**63 - 1),
    deliver_at_ms=st.integers(-(2**63), 2**63 - 1),
    msg_id=text,
    subject=text,
    payload=st.binary(max_size=100),
    tags=st.lists(text, max_size=4).map(tuple),
    properties=st.lists(st.tuples(text, st.text(max_size=30)), max_size=4).map(tuple),
    attempts=st.integers(0, 65535),
    kind=st.sampled_from([records.KIND_MESSAGE, records.KIND_CANCEL]),
)


@settings(max_examples=200, deadline=None)
@given(messages)
def test_round_trip(m):
    body = records.encode(m)
    assert records.decode(body) == m
    assert records.peek_header(body) == (m.kind, m.seq, m.deliver_at_ms, m.attempts)
    assert records.peek_id(body) == m.msg_id


@settings(max_examples=100, deadline=None)
@given(messages, st.data())
def test_truncated_or_extended_body_is_rejected(m, data):
    body = records.encode(m)
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(InvalidArgument):
        records.decode(body[:cut])
    with pytest.raises(InvalidArgument):
        records.decode(body + b"\x00")


def test_unknown_version_and_kind():
    body = bytearray(records.encode(Message(1, 2, 3, "id", "s")))
    body[0] = 9
    with pytest.raises(InvalidArgument, match="version"):
        records.decode(bytes(body))
    body[0] = 1
    body[1] = 7
    with pytest.raises(InvalidArgument, match="kind"):
        records.decode(bytes(body))


def _msg(**kw):
    base = dict(seq=0, store_ms=0, deliver_at_ms=1000, msg_id="order-1", subject="orders.cancel")
    base.update(kw)
    return Message(**base)


@pytest.mark.parametrize("kw,field", [
    (dict(subject=""), "subject"),
    (dict(subject="has space"), "subject"),
    (dict(subject="x" * 201), "subject"),
    (dict(msg_id=""), "id"),
    (dict(msg_id="a b"), "id"),
    (dict(msg_id="x" * 129), "id"),
    (dict(tags=tuple(f"t{i}" for i in range(17))), "tags"),
    (dict(deliver_at_ms=10**15), "deliver_at_ms"),
])
def test_limits(kw, field):
    with pytest.raises(InvalidArgument) as e:
        records.validate_message(_msg(**kw), now_ms=0)
    assert e.value.field == field


def test_payload_limit_and_horizon_configurable():
    lim = Limits(payload_bytes_max=10, delay_horizon_ms=5000)
    with pytest.raises(PayloadTooLarge):
        records.validate_message(_msg(payload=b"x" * 11), now_ms=0, limits=lim)
    records.validate_message(_msg(payload=b"x" * 10, deliver_at_ms=5000), now_ms=0, limits=lim)
    with pytest.raises(InvalidArgument):
        records.validate_message(_msg(deliver_at_ms=5001), now_ms=0, limits=lim)
    records.validate_message(_msg(deliver_at_ms=0), now_ms=10**12)  # past due: deliver now


def test_dispatched_round_trip():
    d = Dispatched(seq=5, deliver_at_ms=-3, dispatched_ms=7, outcome=Dispatched.DEAD_LETTER)
    assert records.decode_dispatched(records.encode_dispatched(d)) == d
    with pytest.raises(InvalidArgument):
        records.decode_dispatched(b"short")
