"""Send one message through a cluster and wait for it (bounded), the round trip many tests need."""

from __future__ import annotations

POLLS_MAX = 20   # long polls of POLL_WAIT_MS each
POLL_WAIT_MS = 500


async def receive_ids(consumer, want: set[str]) -> set[str]:
    """Pull and acknowledge until every id of ``want`` arrived or POLLS_MAX polls passed;
    everything received."""
    got: set[str] = set()
    for _ in range(POLLS_MAX):
        batch = await consumer.pull(wait_ms=POLL_WAIT_MS)
        got.update(m.id for m in batch)
        await consumer.ack(batch)
        if want <= got:
            break
    return got


async def round_trip(resolver, subject: str, msg_id: str, payload: bytes = b"x", delay_ms: int = 100) -> set[str]:
    """Schedule ``msg_id`` on ``subject`` and receive it in group ``g``: the ids received."""
    from cluster.client import Consumer, Producer

    async with Producer(resolver) as p, Consumer(resolver, subject, group="g") as cons:
        await p.send_and_wait(subject, payload, delay_ms=delay_ms, id=msg_id)
        return await receive_ids(cons, {msg_id})


async def send_all(meta_addresses: list[str], subject: str, ids: list[str], *, refresh_ms: int, **kw) -> None:
    """Send ``ids`` (payload ``x``) on ``subject`` with a producer of its own (its own resolver,
    ``retries_max`` 40, so that a failover while it sends is retried through) and assert every
    one was answered without an error. ``kw``: ``send_many``'s (``deliver_at_ms``, ``immediate``)."""
    from cluster.client import Producer
    from cluster.discovery import MetaResolver

    res = MetaResolver(meta_addresses, refresh_ms=refresh_ms)
    try:
        async with Producer(res, retries_max=40) as p:
            out = await (await p.send_many(subject, [b"x"] * len(ids), ids=ids, **kw))
    finally:
        await res.close()
    assert not out.errors, out.errors
