"""The registration a node keeps at the meta servers when ``meta_servers`` is set, renewed
on a thread of its own so that a busy event loop does not let the lease run out.

    registrar = Registrar(settings, address, describe=node.registration_info, health=node.health)
    registrar.on_beat = member_keepalive      # (lease_id, sent_ms), called on the heartbeat thread
    registrar.on_lost = member_lease_lost     # (lease_id), called on the heartbeat thread
    tg.create_task(registrar.run())           # register, then renew every heartbeat_ms
    ...
    await registrar.close()                   # clean stop: the thread ends, the lease is revoked

Why a thread (issue 26): renewals used to run on the node's event loop and queued behind
message work; a promotion holding the loop 0.4-0.7 s plus a paused meta server let 2 s
leases expire under live masters, and the group flapped. Now:

* **The heartbeat thread** sends Register and Heartbeat with blocking calls on plain gRPC
  channels (``BlockingMetaClient``), with no event loop of its own: every asyncio loop that
  uses ``grpc.aio`` is woken by every gRPC event of the process (the aio poller is shared),
  so a loop of its own woke on each of the main loop's calls and handed half of them over.
  A heartbeat is sent ``heartbeat_ms`` after the previous one was *sent* (not answered).
* **The main loop** keeps ``self.meta`` (its own ``MetaClient`` for every other call: the
  role loop's Leader, Campaign, GetServers ...), ``registered`` and ``lease_id`` (changed
  only on the main loop, together, through ``call_soon_threadsafe``, so code on the loop
  sees them agree), the readiness health status, and one small task that every
  ``STAMP_INTERVAL_MS_MAX`` (1 s, or an eighth of ``loop_stall_max_ms`` if less) stamps
  ``loop_alive_at`` and, every half heartbeat interval, snapshots ``describe()`` into the
  ``NodeInfo`` the thread sends. ``describe()`` is thus
  only ever called on the main loop; the thread reads a finished protobuf message.
* **Liveness gate.** While the stamp is older than ``loop_stall_max_ms`` the thread sends
  nothing (logged once per stall, counted in ``hourglass_heartbeats_withheld``): a wedged
  event loop must not keep a master's seat forever. The lease then runs out after its TTL
  and the node registers again once its loop turns.

Callbacks (assign as attributes; both optional):

* ``on_beat(lease_id, sent_ms)``: called **on the heartbeat thread** as soon as a Register
  or Heartbeat sent at monotonic ms ``sent_ms`` under ``lease_id`` was confirmed: the lease
  lives at least until ``sent_ms + TTL``. The receiver must be thread-safe (a lock). For the
  older one-argument form ``on_beat(sent_ms)`` (a callable with one positional parameter,
  checked once when assigned) the call is made **on the main loop** through
  ``call_soon_threadsafe`` instead, as before this thread existed.
* ``on_lost(lease_id)``: called **on the heartbeat thread**, at once, when the registration
  under ``lease_id`` is found lost (``NotFound``: the lease expired; or ``AlreadyExists``:
  another registration holds the id), *before* registering again: registering again revokes
  the old lease and so deletes a leader key attached to it.

* ``on_fences(revision, [(subject, draining, consumers)], watch)``: a real-time node's fences
  (``node/realtime/fence.py``) and the subjects draining anywhere, from every Register and
  Heartbeat answer, called **on the main loop**; after a Register it runs before
  ``registered`` is set, so a node has its fences before it serves.
* ``drained()``: called on the main loop with ``describe()``; what it returns (a master's
  drained subjects) goes on the next heartbeats (``HeartbeatRequest.drained``).
* ``consumers()``: likewise; ``(watch revision, [(subject, [consumer group])])``, a master's
  consumer groups of the watched subjects (``HeartbeatRequest.consumers``).
* ``on_merged(revision)``: called on the main loop when an answer says the report made at
  watch ``revision`` is recorded (``HeartbeatResponse.consumers_merged``).

Answers and what the thread does about them:

* ``NotFound`` (the lease expired: the node was frozen, or etcd lost it) -> ``on_lost``,
  then register again at once;
* ``AlreadyExists`` (another live process holds this node id) -> log an error and
  retry every ``heartbeat_ms`` until that lease is gone; the node keeps serving;
* ``Unavailable`` (no meta server answers, or etcd is down) -> retry with backoff
  up to the heartbeat interval; the node keeps serving with the routes it has;
* ``InvalidArgument`` (this node's own settings are malformed) -> raised from ``run()``: a
  node that cannot describe itself must not run silently unregistered.

What the thread cannot do: a main thread holding the GIL without letting go (one long C
call) stops it too; pure-Python work hands the GIL over every ``sys.getswitchinterval()``
(5 ms), so a busy loop only slows renewals by a few ms (docs/replication.md, "Lease timing
under load", has the figures).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from cluster import errors as E
from cluster.discovery import BlockingMetaClient, MetaClient
from cluster.proto import meta_pb2 as mpb
from node.config import NodeSettings
from node.grpcserver import READY_SERVICE

log = logging.getLogger("hourglass.registration")

BACKOFF_MS_MIN = 100
HEARTBEAT_MS_MAX = 1000  # a third of the TTL, at most 1 s: the renewal gap must stay well inside TTL - margin
STAMP_INTERVAL_MS = 100        # the heartbeat thread looks again this often while it withholds heartbeats
STAMP_INTERVAL_MS_MAX = 1000   # the main loop proves it turns this often (liveness gate), or an eighth of
                               # loop_stall_max_ms if that is less: at rest it wakes once a second for it
THREAD_STOP_TIMEOUT_S = 5.0    # close()/cancel wait at most this long for the heartbeat thread
THREAD_JOIN_TIMEOUT_S = 1.0    # ... and then for it to return once it said it ended


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def node_info(settings: NodeSettings, address: str, info: dict) -> mpb.NodeInfo:
    sv = settings.server
    return mpb.NodeInfo(role=sv.role, group=sv.group, node_id=sv.node_id, address=address,
                        master=bool(info.get("master", True)),
                        offsets={k: int(v) for k, v in info.get("offsets", {}).items()},
                        lag_ms=int(info.get("lag_ms", 0)), lag_bytes=int(info.get("lag_bytes", 0)),
                        epoch=int(info.get("epoch", 0)))


def takes_lease_id(fn: Callable) -> bool:
    """True for ``on_beat(lease_id, sent_ms)``, False for the older ``on_beat(sent_ms)``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


class Registrar:
    def __init__(self, settings: NodeSettings, address: str, *, describe: Callable[[], dict], health=None,
                 metrics=None) -> None:
        self.settings = settings
        self.address = address
        self.describe = describe  # called on the main loop only (the snapshot task)
        # the main loop's client, for every call but Register/Heartbeat (those use the thread's own)
        self.meta = MetaClient(settings.meta.servers, timeout_s=settings.meta.timeout_ms / 1000)
        self.lease_id: int | None = None  # main-loop view; changes with ``registered``
        self.heartbeat_ms = settings.meta.heartbeat_ms or max(BACKOFF_MS_MIN, min(HEARTBEAT_MS_MAX,
                                                                                   settings.meta.lease_ttl_ms // 3))
        self.registered = asyncio.Event()
        self.heartbeats = 0  # confirmed Register/Heartbeat calls
        self.on_lost: Callable[[int], None] | None = None
        # a real-time node's fences (node/realtime/fence.py): on_fences(revision, [(subject, draining)])
        # is called on the main loop with every Register/Heartbeat answer (before ``registered``
        # is set after a Register); drained() is snapshotted with describe() and sent on heartbeats
        self.on_fences: Callable[[int, list], None] | None = None
        self.drained: Callable[[], list[str]] | None = None
        self.consumers: Callable[[], tuple[int, list]] | None = None
        self.on_merged: Callable[[int], None] | None = None
        self._on_beat: Callable | None = None
        self._beat_on_thread = False
        # the node's grpc.health.v1 servicer (start_grpc's): its readiness service follows the registration
        self.health = health
        self.metrics = metrics  # NodeMetrics (side_tasks attaches the node's); observed from the thread
        self.loop_alive_at = time.monotonic()  # stamped by the main loop; read by the thread
        # describe() (and drained()) snapshot, replaced (never changed) on the main loop
        self._info: mpb.HeartbeatRequest | None = None
        self._lease: int | None = None          # the heartbeat thread's view
        self._last_sent_ms: int | None = None   # send time of the last confirmed call under _lease
        self._main: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ended: asyncio.Future | None = None  # main-loop future: the thread ended (its error, if any)
        self._lock = threading.Lock()  # guards the two below
        self._stopping = False
        self._beat_meta: BlockingMetaClient | None = None  # the thread's client (cancelled to stop it)
        self._stop = threading.Event()  # the thread's sleeps end at once when set
        self._ready_tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ callbacks

    @property
    def on_beat(self) -> Callable | None:
        return self._on_beat

    @on_beat.setter
    def on_beat(self, fn: Callable | None) -> None:
        self._beat_on_thread = fn is not None and takes_lease_id(fn)
        self._on_beat = fn

    def _confirmed(self, lease_id: int, sent_ms: int) -> None:
        """Heartbeat thread: a call sent at ``sent_ms`` under ``lease_id`` was confirmed."""
        fn = self._on_beat
        if fn is None:
            return
        if self._beat_on_thread:
            fn(lease_id, sent_ms)
        else:
            self._post(fn, sent_ms)

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        """Start the heartbeat thread and the main-loop duties; return when ``close()`` stopped
        the thread, raise what ended it otherwise. Cancelled: the thread is stopped first."""
        if self._thread is not None:
            raise RuntimeError("Registrar.run() may be called once")
        self._main = asyncio.get_running_loop()
        self._snapshot()
        self.loop_alive_at = time.monotonic()
        self._ended = self._main.create_future()
        self._thread = threading.Thread(target=self._thread_main, name=f"heartbeat-{self.settings.server.node_id}",
                                        daemon=True)
        self._thread.start()
        duties = asyncio.create_task(self._main_duties(), name="registration-duties")
        try:
            done, _ = await asyncio.wait({self._ended, duties}, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                f.result()  # the thread's error (InvalidArgument), or describe()'s
        finally:
            duties.cancel()
            await self._stop_thread()

    async def _main_duties(self) -> None:
        """Prove the loop turns (``loop_alive_at``) and keep the describe() snapshot fresh."""
        snapshot_at = time.monotonic()
        stamp_s = min(STAMP_INTERVAL_MS_MAX, self.settings.loop.stall_max_ms // 8) / 1000
        while True:
            now = time.monotonic()
            self.loop_alive_at = now
            if now - snapshot_at >= self.heartbeat_ms / 2000:
                self._snapshot()
                snapshot_at = now
            await asyncio.sleep(min(stamp_s, self.heartbeat_ms / 2000))

    def _snapshot(self) -> None:
        info = node_info(self.settings, self.address, self.describe())
        try:
            drained = list(self.drained()) if self.drained is not None else []
        except Exception:  # noqa: BLE001 - a drain claim is optional; the registration must not stop for it
            log.exception("drained subjects not reported node_id=%s", self.settings.server.node_id)
            drained = []
        try:
            watch_revision, consumers = self.consumers() if self.consumers is not None else (0, [])
        except Exception:  # noqa: BLE001 - likewise optional: the drains wait for it, nothing else does
            log.exception("consumer groups not reported node_id=%s", self.settings.server.node_id)
            watch_revision, consumers = 0, []
        # one object: the thread sends a claim with the record (fence revision) it was made with
        self._info = mpb.HeartbeatRequest(
            node=info, drained=drained, watch_revision=watch_revision,
            consumers=[mpb.SubjectConsumers(subject=s, groups=g) for s, g in consumers])

    def _post_fences(self, resp) -> None:
        """Heartbeat thread: hand an answer's fences to the main loop (before anything else
        posted after it, so a node registered again has its fences before it is ``registered``)."""
        if self.on_fences is not None:
            fences = [(f.subject, f.draining, tuple(f.consumers), tuple(f.released)) for f in resp.fences]
            self._post(self.on_fences, resp.fence_revision, fences, tuple(resp.watch))

    def _post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the main loop (from the heartbeat thread)."""
        try:
            self._main.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the main loop is closed: the node is gone
            pass

    def _set_registered(self, lease_id: int | None) -> None:
        """Main loop: ``lease_id`` and ``registered`` change together, readiness follows."""
        self.lease_id = lease_id
        if lease_id is None:
            self.registered.clear()
        else:
            self.registered.set()
        if self.health is not None:
            t = asyncio.get_running_loop().create_task(self._ready(lease_id is not None))
            self._ready_tasks.add(t)
            t.add_done_callback(self._ready_tasks.discard)

    async def _ready(self, ready: bool) -> None:
        await self.health.set(READY_SERVICE, health_pb2.HealthCheckResponse.SERVING if ready
                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _stop_thread(self) -> None:
        """Ask the heartbeat thread to stop and wait (bounded) until it has."""
        with self._lock:
            self._stopping = True
            meta = self._beat_meta
        self._stop.set()
        if meta is not None:
            meta.cancel()  # a call in flight ends now
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        _, pending = await asyncio.wait({self._ended}, timeout=THREAD_STOP_TIMEOUT_S)
        if pending:
            log.warning("heartbeat thread of node_id=%s did not stop within %.0f s", self.settings.server.node_id,
                        THREAD_STOP_TIMEOUT_S)
            return
        thread.join(THREAD_JOIN_TIMEOUT_S)  # it said it ended: only its return is left

    async def close(self) -> None:
        """Stop the heartbeat thread, then revoke the lease (best effort, bounded): a cleanly
        stopped node disappears at once. Stopping the thread first means no heartbeat can
        race the revoke (and register again after it)."""
        try:
            await self._stop_thread()
            lease = self._lease
            if lease is not None:
                await self.meta.call("Deregister", mpb.DeregisterRequest(lease_id=lease,
                                                                         node_id=self.settings.server.node_id),
                                     timeout_s=1.0)
        except E.HourglassError as e:
            log.info("deregister failed node_id=%s: %s (the lease will expire)", self.settings.server.node_id, e)
        finally:
            self._lease = None
            self.lease_id = None
            await self.meta.close()

    # ------------------------------------------------------------------ heartbeat thread

    def _thread_main(self) -> None:
        err: BaseException | None = None
        try:
            self._beat_main()
        except BaseException as e:  # noqa: BLE001 - handed to run() on the main loop, which raises it
            err = e
        self._post(self._thread_ended, err)

    def _thread_ended(self, err: BaseException | None) -> None:
        if self._ended is not None and not self._ended.done():
            if err is None:
                self._ended.set_result(None)
            else:
                self._ended.set_exception(err)

    def _beat_main(self) -> None:
        meta = BlockingMetaClient(self.settings.meta.servers, timeout_s=self.settings.meta.timeout_ms / 1000)
        with self._lock:
            if self._stopping:
                meta.close()
                return
            self._beat_meta = meta
        try:
            self._beat_forever(meta)
        finally:
            with self._lock:
                self._beat_meta = None
            meta.close()

    def _loop_stalled_ms(self) -> int:
        return int((time.monotonic() - self.loop_alive_at) * 1000)

    def _beat_forever(self, meta: BlockingMetaClient) -> None:
        """Until ``_stop`` is set."""
        failures = 0
        withheld_since: float | None = None
        while not self._stop.is_set():
            stalled_ms = self._loop_stalled_ms()
            if stalled_ms > self.settings.loop.stall_max_ms:
                if withheld_since is None:  # once per stall
                    withheld_since = time.monotonic()
                    log.warning("heartbeats withheld node_id=%s: the event loop has not turned for %d ms "
                                "(loop_stall_max_ms=%d); the lease will run out unless it comes back",
                                self.settings.server.node_id, stalled_ms, self.settings.loop.stall_max_ms)
                    if self.metrics is not None:
                        self.metrics.heartbeats_withheld.inc()
                self._stop.wait(STAMP_INTERVAL_MS / 1000)
                continue
            if withheld_since is not None:
                log.warning("heartbeats resume node_id=%s: the event loop turned again after %.0f ms withheld",
                            self.settings.server.node_id, (time.monotonic() - withheld_since) * 1000)
                withheld_since = None
            sent_ms = mono_ms()
            next_ms = sent_ms + self.heartbeat_ms
            try:
                self._beat(meta, sent_ms)
                failures = 0
            except E.NotFound as e:
                self._lost(e)
                next_ms = 0
            except E.AlreadyExists as e:
                log.error("node id %s is in use by another live node: %s", self.settings.server.node_id, e)
                self._lost(e)
            except E.InvalidArgument:
                raise
            except E.HourglassError as e:  # Unavailable and anything unexpected from the meta side
                if self._stop.is_set():  # the call was cancelled to stop the thread
                    return
                failures += 1
                next_ms = mono_ms() + min(self.heartbeat_ms, BACKOFF_MS_MIN * 2 ** min(failures, 8))
                log.warning("heartbeat failed node_id=%s attempt=%d: %s", self.settings.server.node_id, failures, e)
            self._stop.wait(max(0, next_ms - mono_ms()) / 1000)

    def _beat(self, meta: BlockingMetaClient, sent_ms: int) -> None:
        """One Register (no lease) or Heartbeat, sent at ``sent_ms``."""
        if self._lease is None:
            resp = meta.call("Register", mpb.RegisterRequest(node=self._info.node,
                                                             ttl_ms=self.settings.meta.lease_ttl_ms))
            lease = self._lease = resp.lease_id
            if not self.settings.meta.heartbeat_ms:
                self.heartbeat_ms = max(BACKOFF_MS_MIN, resp.heartbeat_ms)
            log.info("registered node_id=%s lease=%x ttl_ms=%d heartbeat_ms=%d via=%s", self.settings.server.node_id,
                     lease, resp.ttl_ms, self.heartbeat_ms, meta.current)
            self._post_fences(resp)
            self._post(self._set_registered, lease)
            self._last_sent_ms = None
        else:
            lease = self._lease
            snap = self._info
            resp = meta.call("Heartbeat", mpb.HeartbeatRequest(
                lease_id=lease, node=snap.node, drained=snap.drained, consumers=snap.consumers,
                watch_revision=snap.watch_revision))
            self._post_fences(resp)
            if resp.consumers_merged and self.on_merged is not None:
                self._post(self.on_merged, resp.consumers_merged)
        confirmed_ms = mono_ms()
        self.heartbeats += 1
        if self.metrics is not None:
            self.metrics.heartbeat_rtt.observe((confirmed_ms - sent_ms) / 1000)
            if self._last_sent_ms is not None:  # how long the lease had to last on its own
                self.metrics.heartbeat_gap.observe((confirmed_ms - self._last_sent_ms) / 1000)
        self._last_sent_ms = sent_ms
        self._confirmed(lease, sent_ms)

    def _lost(self, reason: Exception) -> None:
        """The registration under the thread's lease is gone: tell ``on_lost`` first, then
        the main loop; the next beat registers again."""
        lease = self._lease
        self._lease = None
        self._last_sent_ms = None
        if lease is not None:
            log.warning("registration lost node_id=%s lease=%x (%s); registering again", self.settings.server.node_id,
                        lease, reason)
            if self.metrics is not None:
                self.metrics.registrations_lost.inc()
            if self.on_lost is not None:
                self.on_lost(lease)
            self._post(self._set_registered, None)
