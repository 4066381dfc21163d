"""node/store/records.py: the domain Message round-trips through the one codec; the seq rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.codec import Batch
from cluster.errors import Overloaded
from node.store import records
from node.store.records import Message

ascii_id = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30)
messages = st.builds(
    Message,
    seq=st.integers(0, 2**63 - 1), store_ms=st.integers(0, 2**62), deliver_at_ms=st.integers(0, 2**62),
    msg_id=ascii_id, subject=st.sampled_from(["a", "orders.cancel", "b-2"]), payload=st.binary(max_size=64),
    tags=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
    properties=st.lists(st.tuples(st.text(min_size=1, max_size=8), st.text(max_size=8)), max_size=3).map(tuple),
    attempts=st.integers(0, 65535),
    kind=st.sampled_from([records.KIND_MESSAGE, records.KIND_CANCEL]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(messages, max_size=20))
def test_messages_round_trip_through_the_codec(msgs):
    assert records.messages_of(Batch.decode(records.batch_from_messages(msgs).encode())) == msgs


def test_make_seq_epoch_and_counter():
    assert records.make_seq(3, 7) == (3 << 40) | 7
    assert records.make_seq(1, records.SEQ_COUNTER_MAX) < records.make_seq(2, 0)
    with pytest.raises(Overloaded):
        records.make_seq(1, records.SEQ_COUNTER_MAX + 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "a", "id-7", "é"]), st.binary(max_size=8)), min_size=1, max_size=12))
def test_encoded_bytes_max_is_the_plain_body_with_the_ids_a_node_makes(rows):
    """The bound is the plain body's size, plus ``MADE_ID_BYTES`` for every message sent
    without an id (the node makes one), wherever those sit in the batch."""
    b = Batch.build("s", [p for _, p in rows], [i for i, _ in rows], 0)
    made = sum(1 for i, _ in rows if not i)
    assert records.encoded_bytes_max(b) == len(b.encode()) + made * records.MADE_ID_BYTES
