"""The console's calls to the cluster, made with the viewer's token: discovery through the
meta servers, ``Admin/Status`` of every member, ``Lookup``/``Cancel`` through the SDK's
``Producer``, the dead-letter subject through the SDK's ``Consumer``. Errors stay domain
errors (``cluster.errors``); the app shows them.

One ``Viewer`` per token (cached, at most ``VIEWERS_MAX``): the channels of a token are
dialled once and reused. The console makes calls only while a page asks, so a cluster no one
looks at carries no load from it.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass

import grpc
from pydantic import SecretStr

from cluster.errors import UnknownSubject
from cluster.security import ClientSecurity, SecuritySettings
from cluster.status import from_rpc_error

VIEWERS_MAX = 64            # tokens with open channels at once; the least recently used are closed
RPC_TIMEOUT_S = 5.0         # one Status/Lookup/Cancel call
CALL_TIMEOUT_S = 10.0       # one SDK call with its retries
DLQ_SUBJECT = "hourglass.dlq"
DLQ_GROUP = "hourglass-console"   # the console's consumer group on the dead-letter subject
DLQ_HELD_MAX = 500          # dead letters listed on the page, and held (pulled, not yet acked) for an action


@dataclass(frozen=True)
class ConsoleCluster:
    """Where the cluster is and the console's own credentials (the TLS files; a token only
    on an open cluster or for tests: viewers log in with theirs)."""

    meta: tuple[str, ...]
    security: SecuritySettings

    @property
    def secure(self) -> bool:
        return self.security.tls


@dataclass
class DeadLetter:
    wire_id: str
    origin_id: str
    subject: str           # the original subject
    reason: str
    attempts: int
    payload_preview: str
    received_ms: int


def node_certificate(settings: SecuritySettings) -> str | None:
    """The common name of ``settings``' certificate when it is a node certificate, else None.
    The console must not dial with one: a node certificate may do everything, whatever the
    viewer's token (``cluster.security.Authenticator.identify``)."""
    if settings.tls_cert_file is None:
        return None
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from cluster.security import NODE_PREFIX

    cert = x509.load_pem_x509_certificate(settings.tls_cert_file.read_bytes())
    names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return names[0] if names and str(names[0]).startswith(NODE_PREFIX) else None


class Viewer:
    """The cluster as seen with one token."""

    def __init__(self, cluster: ConsoleCluster, token: str | None) -> None:
        from cluster.discovery import MetaResolver
        from cluster.transport import Channels

        fields = {"token": SecretStr(token), "token_file": None} if token else {}
        self.security = ClientSecurity(cluster.security.model_copy(update=fields))
        self.resolver = MetaResolver(list(cluster.meta), security=self.security)
        self.channels = Channels(self.security)
        self._producer = None
        self._dlq_consumer = None
        self.dead: OrderedDict[str, tuple[DeadLetter, object]] = OrderedDict()  # wire id -> (row, Received)
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        for c in (self._producer, self._dlq_consumer):
            if c is not None:
                try:
                    await c.__aexit__(None, None, None)
                except Exception:  # closing: nothing to report to
                    pass
        await self.channels.close()
        await self.resolver.close()

    # ------------------------------------------------------------------ cluster

    async def status_rows(self, subject: str = "") -> list[dict]:
        """Every registered member with its Status (a member that does not answer: ``error``);
        ``subject``: delay members add that subject's counts by bucket (``pending_by_subject``)."""
        from cluster.proto import hourglass_pb2 as pb

        groups = await self.resolver.load()
        listed = [{"address": a, "role": role, "group": g["group"]}
                  for role, gs in groups.items() for g in gs for a in g["members"]]

        async def ask(node: dict) -> dict:
            try:
                r = await self.channels.admin(node["address"]).Status(pb.StatusRequest(subject=subject),
                                                                      timeout=RPC_TIMEOUT_S)
                return node | json.loads(r.json)
            except grpc.RpcError as e:
                return node | {"error": str(from_rpc_error(e))[:200]}
            except ValueError as e:
                return node | {"error": f"unreadable status: {e}"[:200]}
        return list(await asyncio.gather(*(ask(n) for n in listed)))

    # ------------------------------------------------------------------ messages

    async def producer(self):
        from cluster.client import Producer

        if self._producer is None:
            p = Producer(self.resolver, timeout_s=RPC_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
            self._producer = await p.__aenter__()
        return self._producer

    async def lookup(self, msg_id: str) -> dict:
        return asdict(await (await self.producer()).lookup(msg_id))

    async def trace(self, msg_id: str) -> dict:
        """The Lookup as a dict with the real-time node's answer (``Producer.trace``)."""
        return (await (await self.producer()).trace(msg_id)).as_dict()

    async def cancel(self, msg_id: str) -> dict:
        return asdict(await (await self.producer()).cancel(msg_id))

    # ------------------------------------------------------------------ dead letters

    async def _dlq(self):
        from cluster.client import Consumer

        if self._dlq_consumer is None:
            c = Consumer(self.resolver, DLQ_SUBJECT, group=DLQ_GROUP, wait_ms=200, timeout_s=RPC_TIMEOUT_S,
                         call_timeout_s=CALL_TIMEOUT_S)
            self._dlq_consumer = await c.__aenter__()
        return self._dlq_consumer

    @staticmethod
    def _row(m) -> DeadLetter:
        props = m.properties or {}
        return DeadLetter(wire_id=m.wire_id, origin_id=props.get("hourglass.origin_id", m.id),
                          subject=props.get("dlq.subject", "?"), reason=props.get("dlq.reason", "?"),
                          attempts=m.attempts, payload_preview=repr(bytes(m.payload[:80])), received_ms=m.received_ms)

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters the console's group has not acked (sent back or purged), read
        without consuming (``Consumer/Browse``): up to ``DLQ_HELD_MAX``, oldest first."""
        async with self._lock:
            try:
                page = await (await self._dlq()).browse(max_messages=DLQ_HELD_MAX)
            except UnknownSubject:  # nothing was ever dead-lettered on that node
                return []
            return [self._row(m) for m in page.messages]

    async def _take(self, wire_ids: list[str]) -> list[tuple[DeadLetter, object]]:
        """The selected dead letters in hand (pulled into the console's group, not acked): the
        ones held already, then pulls until each is in hand or a pull brings nothing new (one
        another console holds stays with it until its ack timeout). At most ``DLQ_HELD_MAX``
        held; unselected ones pulled meanwhile stay held for a later action."""
        want = [w for w in dict.fromkeys(wire_ids)]
        c = await self._dlq()
        while any(w not in self.dead for w in want) and len(self.dead) < DLQ_HELD_MAX:
            got = await c.pull(max_messages=DLQ_HELD_MAX - len(self.dead), wait_ms=200)
            if not got:
                break
            for m in got:
                self.dead[m.wire_id] = (self._row(m), m)
        return [self.dead[w] for w in want if w in self.dead]

    async def send_back(self, wire_ids: list[str]) -> int:
        """Each selected dead letter produced again, now, to its original subject (with a new
        wire id, ``{wire id}~back``: the real-time side would drop the old one as a duplicate;
        the original id in ``hourglass.origin_id``, which the SDK shows as ``Received.id``),
        then acked in the console's group. Returns how many went back."""
        async with self._lock:
            picked = await self._take(wire_ids)
            p = await self.producer()
            sent = []
            for row, msg in picked:
                if row.subject == "?":
                    continue
                # the origin id travels as the SDK's retries carry it: consumers see the id they know
                fut = await p.send_many(row.subject, [bytes(msg.payload)], ids=[f"{row.wire_id}~back"],
                                        immediate=True, properties={"hourglass.origin_id": row.origin_id})
                res = await fut
                if res.errors:
                    raise res.errors[min(res.errors)]
                sent.append((row.wire_id, msg))
            if sent:
                await (await self._dlq()).ack([m for _, m in sent])
                for w, _ in sent:
                    self.dead.pop(w, None)
            return len(sent)

    async def purge(self, wire_ids: list[str]) -> int:
        """Ack (drop) the selected dead letters in the console's group."""
        async with self._lock:
            picked = await self._take(wire_ids)
            if picked:
                await (await self._dlq()).ack([m for _, m in picked])
            for row, _ in picked:
                self.dead.pop(row.wire_id, None)
            return len(picked)


class Viewers:
    """One ``Viewer`` per token, the least recently used closed beyond ``VIEWERS_MAX``."""

    def __init__(self, cluster: ConsoleCluster) -> None:
        self.cluster = cluster
        self._by_token: OrderedDict[str | None, Viewer] = OrderedDict()

    async def get(self, token: str | None) -> Viewer:
        v = self._by_token.get(token)
        if v is None:
            while len(self._by_token) >= VIEWERS_MAX:
                _, old = self._by_token.popitem(last=False)
                await old.close()
            v = self._by_token[token] = Viewer(self.cluster, token)
        self._by_token.move_to_end(token)
        return v

    async def drop(self, token: str | None) -> None:
        v = self._by_token.pop(token, None)
        if v is not None:
            await v.close()

    async def close(self) -> None:
        while self._by_token:
            _, v = self._by_token.popitem()
            await v.close()


__all__ = ["ConsoleCluster", "DeadLetter", "Viewer", "Viewers"]
