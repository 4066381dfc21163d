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
