"""The consumer says when a real-time node is unreachable and when it is back (issue 26): each
change of state is logged once, not once per retry, and ``Consumer.health()`` shows it per node
(address, ``ok`` / ``unreachable``, since when, the last error, failed pulls in a row).

Against the in-process fake node (``tests/helpers/fake_node.py``), stopped and started again on
the same port while a consumer iterates ``batches()``; and ``_health_step``, the pure rule.
Every wait is a bounded loop on an outcome, never a duration.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from cluster import errors as E
from cluster.client import NODE_OK, NODE_UNREACHABLE, Consumer, NodeHealth, StaticResolver, _health_step
from tests.helpers.fake_node import FakeNode

POLL_S = 0.05
POLLS_MAX = 1200  # 60 s of polls at most: every wait below ends long before (a hang fails, it does not block)
CLIENT_LOG = "hourglass.client"


async def until(pred, what: str, task: asyncio.Task | None = None):
    for _ in range(POLLS_MAX):
        if task is not None and task.done():
            pytest.fail(f"the consumer stopped ({task.exception()!r}) while waiting for: {what}")
        got = pred()
        if got:
            return got
        await asyncio.sleep(POLL_S)
    pytest.fail(f"never happened: {what}")


def client_lines(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CLIENT_LOG and needle in r.getMessage()]


# ---------------------------------------------------------------------- the pure rule


@pytest.mark.unit
def test_health_step_changes_state_only_on_a_change():
    h, changed = _health_step(None, "n:1", None, 100)
    assert h == NodeHealth("n:1", NODE_OK, 100, "", 0) and not changed  # first answer: nothing to say
    h, changed = _health_step(h, "n:1", E.Unavailable("down"), 200)
    assert (h.state, h.since_ms, h.last_error, h.failures, changed) == (NODE_UNREACHABLE, 200, "down", 1, True)
    h, changed = _health_step(h, "n:1", E.Unavailable("still down " + "x" * 1000), 300)
    assert (h.since_ms, h.failures, changed) == (200, 2, False) and len(h.last_error) == 300
    h, changed = _health_step(h, "n:1", None, 400)
    assert (h.state, h.since_ms, h.failures, changed) == (NODE_OK, 400, 0, True)
    assert h.last_error.startswith("still down")  # kept: what happened last
    h2, changed = _health_step(h, "n:1", None, 500)
    assert h2 is h and not changed
    h, changed = _health_step(None, "n:2", E.Unavailable("refused"), 600)  # fails before it ever answered
    assert (h.state, h.since_ms, changed) == (NODE_UNREACHABLE, 600, True)


# ---------------------------------------------------------------------- a node stopped and started again


async def test_a_node_down_then_back_is_logged_once_each_way_and_shown_by_health(caplog):
    caplog.set_level(logging.INFO, logger=CLIENT_LOG)
    node = await FakeNode().start()
    port, address = int(node.address.rsplit(":", 1)[1]), node.address
    got: list[str] = []
    c = Consumer(StaticResolver(realtime=[address]), "orders", group="g", wait_ms=200, timeout_s=2,
                 backoff_ms_min=10, backoff_ms_max=200)

    async def consume():
        async for rb in c.batches():
            got.extend(rb.ids)
            await rb.ack()

    task = asyncio.create_task(consume())
    try:
        node.ready("orders", ["a"])
        await until(lambda: got == ["a"] and node.acked, "the first message, acked", task)  # no ack left to fail
        h = c.health()[address]
        assert (h.address, h.state, h.failures) == (address, NODE_OK, 0)
        await node.stop()
        # retried again and again in the background, said once
        await until(lambda: c.health()[address].failures >= 4, "four failed pulls in a row", task)
        h = c.health()[address]
        assert h.state == NODE_UNREACHABLE and h.last_error and h.since_ms > 0
        assert len(client_lines(caplog, "real-time node unreachable")) == 1
        assert address in client_lines(caplog, "real-time node unreachable")[0]
        node = await FakeNode().start(port)  # back, on the same address
        node.ready("orders", ["b"])
        await until(lambda: "b" in got, "the message sent after the node came back", task)
        back = c.health()[address]
        assert back.state == NODE_OK and back.since_ms >= h.since_ms and back.failures == 0
        assert back.last_error  # what happened last is kept
        assert len(client_lines(caplog, "real-time node unreachable")) == 1
        lines = client_lines(caplog, "real-time node back")
        assert len(lines) == 1 and address in lines[0] and "failed_pulls=" in lines[0]
    finally:
        await c.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await node.stop()


class Moving(StaticResolver):
    """A resolver whose subject moves to another node (a failover, a new route)."""

    def __init__(self, address: str) -> None:
        super().__init__(realtime=[address])

    async def realtime_for(self, subject: str) -> str:
        return self.realtime[0]


async def test_health_lists_the_nodes_serving_the_subjects_now(caplog):
    caplog.set_level(logging.INFO, logger=CLIENT_LOG)
    a, b = await FakeNode().start(), await FakeNode().start()
    resolver = Moving(a.address)
    try:
        async with Consumer(resolver, "orders", group="g", wait_ms=0, timeout_s=2, backoff_ms_min=1,
                            backoff_ms_max=20) as c:
            await a.stop()
            with pytest.raises(E.Unavailable):
                await c.pull()
            assert c.health()[a.address].state == NODE_UNREACHABLE
            resolver.realtime = [b.address]  # the subject moved
            b.ready("orders", ["x"])
            msgs = []
            for _ in range(POLLS_MAX):
                msgs = await c.pull()
                if msgs:
                    break
            assert [m.id for m in msgs] == ["x"]
            assert list(c.health()) == [b.address] and c.health()[b.address].state == NODE_OK
    finally:
        await a.stop()
        await b.stop()
