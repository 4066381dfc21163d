"""Creation rounds of new subjects, off the event loop, with per-principal quotas.

``await creator.create(names, owner)`` (SendBatch and Pull of a ``RealtimeNode``) asks for
the subjects the store does not know yet. The creator's loop (``run``, in the node's
TaskGroup) takes every name asked for since the last round, up to ``round_max``, plans one
round on the loop (``RealtimeStore.subjects_plan``), runs it on a worker thread
(``SubjectWork.run``: one ``index/`` fsync, one journal record and fsync, however many
subjects) and registers the subjects on the loop (``subjects_finish``), then wakes the
requests that asked. Requests that arrive while a round runs share the next one; a name
already asked for by another request is waited for, not asked again. Meanwhile the loop
serves everything else: a send to subjects that exist never waits behind new ones.

Quotas (``cluster/quota.py``): the names a request adds to a round are admitted against
its principal's bucket and owned count first; the ones past a quota are answered at once
with ``QuotaExceeded`` and never reach a round. ``owner=None`` (a node: a delay node's
dispatch, a replica) is not limited per principal; the store's ``subjects_max`` still is.
A name the round refuses (``subjects_max``, a bad name) or could not write is refunded.

Bounds: a round holds at most ``round_max`` names; names waiting for a round are bounded by
the requests in flight (each at most ``batch_messages_max`` subjects), which gRPC bounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from cluster.clock import Clock
from cluster.errors import Closed, DiskFull, HourglassError, Unavailable
from cluster.quota import SubjectQuotas
from node.aio import finish_then_cancel
from node.realtime.store import RealtimeStore
from node.store.diskspace import is_enospc

log = logging.getLogger("hourglass.realtime.creator")


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a refusal nobody waits for any more is not "never retrieved"


class SubjectCreator:
    def __init__(self, store: Callable[[], RealtimeStore], quotas: SubjectQuotas, clock: Clock, *,
                 round_max: int) -> None:
        self._store = store              # the node's current store (a role change swaps it)
        self.quotas = quotas
        self.clock = clock
        self.round_max = round_max
        self._pending: dict[str, tuple[str | None, asyncio.Future]] = {}  # name -> (quota owner, future)
        self._inflight: dict[str, asyncio.Future] = {}                   # names of the round running
        self._wake = asyncio.Event()
        self._running = False
        self.rounds = 0
        self.created = 0

    async def create(self, names: Sequence[str], owner: str | None) -> dict[str, HourglassError]:
        """Create the subjects of ``names`` that do not exist; returns the refused ones and why.
        ``owner``: the principal the quotas count against (None: not limited)."""
        if not self._running:
            raise Unavailable("subject creation is not running (the node is starting or stopping)")
        store = self._store()
        waits: dict[str, asyncio.Future] = {}
        mine: list[str] = []
        for s in store.missing_subjects(names):
            hit = self._pending.get(s)
            f = hit[1] if hit is not None else self._inflight.get(s)
            if f is not None:
                waits[s] = f
            else:
                mine.append(s)
        refused: dict[str, HourglassError] = {}
        if mine and owner is not None:
            adm = self.quotas.admit(owner, len(mine), now_ms=self.clock.now_ms())
            if adm.refusal is not None:
                log.info("subject quota: refused principal=%s limit=%s subjects=%d", owner, adm.refusal.limit,
                         len(mine) - adm.granted)
                refused.update(dict.fromkeys(mine[adm.granted:], adm.refusal))
                mine = mine[:adm.granted]
        loop = asyncio.get_running_loop()
        for s in mine:
            fut = loop.create_future()
            fut.add_done_callback(_retrieve)
            self._pending[s] = (owner, fut)
            waits[s] = fut
        if mine:
            self._wake.set()
        for s, f in waits.items():
            try:
                await asyncio.shield(f)  # a request that goes away does not cancel the others' round
            except HourglassError as e:
                refused[s] = e
        return refused

    async def run(self) -> None:
        """The rounds, one at a time, for as long as the node serves (its TaskGroup)."""
        self._running = True
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    await self._round()
        finally:
            self._running = False
            err = Closed("subject creation stopped (the node is stopping or changing role)")
            for owner, f in [*self._pending.values(), *((None, f) for f in self._inflight.values())]:
                if not f.done():
                    f.set_exception(err)
            self._pending.clear()
            self._inflight.clear()

    async def _round(self) -> None:
        names = list(self._pending)[:self.round_max]
        taken = {s: self._pending.pop(s) for s in names}
        store = self._store()
        try:
            work = store.subjects_plan([(s, owner or "") for s, (owner, _) in taken.items()],
                                       now_ms=self.clock.now_ms())
        except HourglassError as e:  # the store closed (a role change): the requests see it, refund
            self._settle(taken, {s: e for s in taken})
            return
        self._inflight = {s: f for s, (_, f) in taken.items()}
        failed: dict[str, HourglassError] = dict(work.refused)
        try:
            # a cancellation (role change) waits for the thread: it may still be creating files
            # and opening their descriptors, which subjects_finish takes or closes
            await finish_then_cancel(asyncio.get_running_loop().run_in_executor(None, work.run))
        except OSError as e:
            why = DiskFull(f"creating {len(work.items)} subjects: {e}") if is_enospc(e) else \
                Unavailable(f"creating {len(work.items)} subjects failed: {e}")
            log.error("subject creation failed path=%s subjects=%d error=%s", store.root, len(work.items), e)
            failed.update(dict.fromkeys(work.names, why))
        finally:
            store.subjects_finish(work)  # also after a failure or a cancellation: the names are free again
            self._inflight = {}
        self.rounds += 1
        made = {s for s in work.names if s not in failed}
        self.created += len(made)
        self._settle(taken, failed, made)

    def _settle(self, taken: dict[str, tuple[str | None, asyncio.Future]], failed: dict[str, HourglassError],
                made: set[str] | None = None) -> None:
        """Answer the round's requests; a principal is refunded every name it was charged for
        and did not create (refused, failed, or created meanwhile by another path)."""
        refunds: dict[str, int] = {}
        for s, (owner, f) in taken.items():
            e = failed.get(s)
            if owner is not None and (made is None or s not in made):
                refunds[owner] = refunds.get(owner, 0) + 1
            if f.done():
                continue
            if e is None:
                f.set_result(None)
            else:
                f.set_exception(e)
        for owner, n in refunds.items():
            self.quotas.refund(owner, n)
