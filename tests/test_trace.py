"""A message's trace (issue 31) against a real local cluster: the delay Lookup's dispatch time
and real-time group, the real-time node's ``Consumer/Trace`` per consumer group, and the hops
``Producer.trace`` / ``hourglass trace`` build from them, in order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster import errors as E
from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster
from cluster.discovery import MetaResolver
from tests.helpers.console import ROOT
from tests.helpers.flow import POLLS_MAX, POLL_WAIT_MS, receive_ids

SUBJECT = "trace.orders"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # meta servers: routes name real-time groups, as a deployed cluster's do; one attempt: a
    # nack dead-letters at once
    c = LocalCluster(tmp_path_factory.mktemp("trace"), meta=True, env={"HOURGLASS_MAX_ATTEMPTS": "1"})
    with c:
        c.wait_registered()
        yield c


@pytest.fixture
async def resolver(cluster):
    r = MetaResolver(cluster.meta_addresses, security=cluster.client_security())
    try:
        yield r
    finally:
        await r.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


async def _nack_until(consumer, msg_id: str) -> bool:
    """Pull in ``consumer``'s group until ``msg_id`` arrives, nack it (bounded); whether it did."""
    for _ in range(POLLS_MAX):
        batch = await consumer.pull(wait_ms=POLL_WAIT_MS)
        hit = [m for m in batch if m.id == msg_id]
        if hit:
            await hit[0].nack()
            return True
    return False


async def test_a_delivered_messages_trace_has_every_hop_in_order(cluster, resolver):
    async with Consumer(resolver, SUBJECT, group="billing") as billing, \
            Consumer(resolver, SUBJECT, group="audit") as audit:
        async with Producer(resolver) as p:
            await p.send_and_wait(SUBJECT, b"order 42", delay_ms=300, id="order-42")
            pending = await p.trace("order-42")
        assert pending.lookup.status in ("pending", "in_flight", "dispatched")
        assert "order-42" in await receive_ids(billing, {"order-42"})
        assert await _nack_until(audit, "order-42")
    # both consumers closed: the billing ack is sent and committed
    async with Producer(resolver) as p:
        t = await p.trace("order-42")
    assert t.realtime_error == ""
    lk, rt = t.lookup, t.realtime
    # dispatched_ms: known (a firing round may send a little ahead of the due time: dispatch_lead_ms)
    assert lk.status == "dispatched" and lk.dispatched_ms > 0 and lk.effective_ms > 0 and not lk.dead_lettered
    # the dispatch record is written once the real-time node answered that it stored the message
    assert rt is not None and rt.group == lk.realtime_group != "" and rt.stored_ms <= lk.dispatched_ms
    states = {g.group: g for g in rt.groups}
    assert states["billing"].state == "acked"
    assert states["audit"].state == "dead_lettered" and states["audit"].copy_id == "order-42~r1"
    assert states["audit"].copy_subject == "hourglass.dlq"

    hops = t.hops(lk.dispatched_ms + 60_000)
    assert [h.name for h in hops] == ["accepted", "filed", "fired", "stored at the real-time node",
                                      "delivered to audit", "nacked by audit", "delivered to billing",
                                      "acked by billing", "dead-lettered", "cancelled"]
    assert [h.state for h in hops] == ["done"] * 9 + ["skipped"]
    assert "order-42~r1" in hops[8].detail and rt.node_id in hops[3].detail
    # accepted: by the delay node of a group of one, named from its term table (node/delay/terms.py)
    assert lk.accepted_node_id == lk.node_id and lk.accepted_node_id in {n.name for n in cluster.delay}
    assert hops[0].detail.startswith(f"by {lk.group} (node {lk.accepted_node_id}, store epoch {lk.store_epoch})")

    # the same from the command line: one hop a line, marked; an unknown id is one error line, exit 4
    meta = ",".join(cluster.meta_addresses)
    out = _cli("trace", "order-42", "--meta", meta)
    assert out.returncode == 0, out.stderr
    marked = [ln.strip().split(" ", 1) for ln in out.stdout.splitlines()[1:]]
    assert [(m, rest.split("  ")[0]) for m, rest in marked] == [("[x]", h.name) for h in hops[:9]] + \
        [("[-]", "cancelled")], out.stdout
    out = _cli("trace", "order-42", "--json", "--meta", meta)
    got = json.loads(out.stdout)
    assert [h["name"] for h in got["hops"]] == [h.name for h in hops]
    assert {g["group"]: g["state"] for g in got["realtime"]["groups"]} == {"audit": "dead_lettered", "billing": "acked"}
    out = _cli("trace", "no-such-id", "--meta", meta)
    assert out.returncode == 4 and out.stderr.startswith("error: ") and "no-such-id" in out.stderr.splitlines()[0]
    assert "Traceback" not in out.stdout + out.stderr


async def test_the_real_time_lookup_answers_by_the_status_table(cluster, resolver):
    from cluster.proto import hourglass_pb2 as pb
    from cluster.status import from_rpc_error
    from cluster.transport import Channels

    async with Producer(resolver) as p:
        await p.send_and_wait(SUBJECT, b"x", delay_ms=100, id="scan-1")
    async with Consumer(resolver, SUBJECT, group="billing") as billing:
        assert "scan-1" in await receive_ids(billing, {"scan-1"})
    ch = Channels()
    try:
        stub = ch.consumer(cluster.realtime[0].address)
        # found by its seq in the de-duplication window (the scan past it: tests/test_trace_rules.py)
        by_window = await stub.Trace(pb.TraceRequest(subject=SUBJECT, id="scan-1"), timeout=10)
        assert by_window.found_by == "window"
        with pytest.raises(Exception) as ei:
            await stub.Trace(pb.TraceRequest(subject=SUBJECT, id="no-such-id"), timeout=10)
        assert isinstance(from_rpc_error(ei.value), E.NotFound)
        with pytest.raises(Exception) as ei:
            await stub.Trace(pb.TraceRequest(subject="trace.none", id="scan-1"), timeout=10)
        assert isinstance(from_rpc_error(ei.value), E.UnknownSubject)
    finally:
        await ch.close()
