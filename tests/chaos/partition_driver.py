"""Network-partition scenario, run *inside* the namespaces of ``tests/chaos/netns.py``.

The pytest process stays in the root namespace, which cannot reach the members, so the
whole scenario runs here, started by ``test_partition.py`` with
``ip netns exec <core> python -m tests.chaos.partition_driver run --net NET.json --root DIR --out OUT.json``:

* member ``core``: etcd (its loopback), the meta server, the real-time node and this driver;
* members ``delay-1`` / ``delay-2``: one delay node each (``ip netns exec`` prefix), one
  replicated group in ``sync`` mode with 2 s leases.

Phase A (master partition): traffic; the delay master's link is cut. A probe started
inside the master's namespace (``probe`` sub-command, the only place that can still reach
it) sends to it directly and polls its ``Status``: fencing means no send answered OK after
the cut and the node reporting "not master" once its lease is over. The slave must take
over (deliveries of already acknowledged messages resume). Heal: the old master must come
back as a caught-up slave, truncating what the probe made it store (a divergent suffix).

Phase B (slave partition): the slave's link is cut; every send to the master must be
answered with an error (``REPLICATION_TIMEOUT``, never a silent OK) until the heal; then
sends succeed again.

Finally everything acknowledged must be received (checked by the test from the JSON).
Every send is one ``SendBatch`` without retries, so each answer is recorded as it came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SUBJECT = "part.a"
BATCH = 10
SEND_PERIOD_S = 0.1
SENDS_INFLIGHT_MAX = 8
SEND_TIMEOUT_S = 8.0
MASTER_PARTITION_S = 9.0
SLAVE_PARTITION_S = 7.0
DRAIN_S_MAX = 40.0
WAIT_S_MAX = 60.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def code_name(code: int) -> str:
    from cluster.proto import hourglass_pb2 as pb

    return pb.Code.Name(code) if code in pb.Code.values() else str(code)


async def send_one_batch(channels, address: str, ids: list[str], deliver_at_ms: list[int]) -> list[str]:
    """One SendBatch, no retry: per id "OK" or the error code name (``rpc:<grpc code>`` on RPC errors)."""
    import grpc

    from cluster.codec import Batch
    from cluster.wire import BatchResult, make_request

    req = make_request(Batch.build(SUBJECT, [b"x"] * len(ids), ids, deliver_at_ms))
    try:
        resp = await channels.producer(address).SendBatch(req, timeout=SEND_TIMEOUT_S)
    except grpc.RpcError as e:
        return [classify_rpc_error(e.code(), e.details() or "")] * len(ids)
    return [code_name(c) for c in BatchResult.from_pb(resp, len(ids)).codes.tolist()]


def classify_rpc_error(code, detail: str) -> str:
    """The broker's answer as a code name. A whole-batch ReplicationTimeout travels as gRPC
    DEADLINE_EXCEEDED with the server's message (``cluster/status.py``); the client's own
    deadline says just "Deadline Exceeded"; anything else is ``rpc:<grpc code>``."""
    import grpc

    if detail.startswith("not the master"):
        return "NOT_LEADER"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and ("no live slave" in detail or "no slave confirmed" in detail):
        return "REPLICATION_TIMEOUT"
    return f"rpc:{code.name}"


# ---------------------------------------------------------------------- probe (in the partitioned namespace)


async def probe(target: str, duration_s: float, ready: Path, out: Path) -> None:
    """Send one message every 200 ms straight to ``target`` and poll its Status; record all."""
    from cluster.proto import hourglass_pb2 as pb
    from cluster.transport import Channels

    ch = Channels()
    sends, status = [], []
    k = 0
    ready.write_text("ready")
    deadline = time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            t = now_ms()
            try:
                r = await ch.admin(target).Status(pb.StatusRequest(), timeout=1)
                status.append({"t": t, "master": bool(r.master), "mode": json.loads(r.json).get("mode")})
            except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                status.append({"t": t, "error": type(e).__name__})
            t = now_ms()
            ids = [f"probe-{os.getpid()}-{k}"]
            k += 1
            # 60 s away: never due inside the run, so a stored-but-unacknowledged copy is visible by lookup
            res = await send_one_batch(ch, target, ids, [t + 60_000])
            sends.append({"id": ids[0], "t": t, "answered": now_ms(), "result": res[0]})
            await asyncio.sleep(0.2)
    finally:
        await ch.close()
        out.write_text(json.dumps({"sends": sends, "status": status}))


# ---------------------------------------------------------------------- scenario (in the core namespace)


class Traffic:
    """Sender and consumer loops; every answer and receive recorded with wall-clock times."""

    def __init__(self, resolver) -> None:
        from cluster.transport import Channels

        self.resolver = resolver
        self.channels = Channels()
        self.sends: list[dict] = []
        self.receives: list[dict] = []
        self.stop = asyncio.Event()
        self.sem = asyncio.Semaphore(SENDS_INFLIGHT_MAX)
        self.n = 0

    async def _batch(self, ids: list[str], due: list[int]) -> None:
        try:
            t = now_ms()
            try:
                master = dict(await self.resolver.delay_groups()).get("delay-g1", "")
                why = "resolve:no-master"
            except Exception as e:  # noqa: BLE001 - recorded as this batch's answer
                master, why = "", f"resolve:{type(e).__name__}"
            res = await send_one_batch(self.channels, master, ids, due) if master else [why] * len(ids)
            done = now_ms()
            if any(r != "OK" for r in res):
                await self.resolver.refresh()
            for i, d, r in zip(ids, due, res):
                self.sends.append({"id": i, "deliver_at": d, "t": t, "answered": done, "result": r, "to": master})
        finally:
            self.sem.release()

    async def send_loop(self) -> None:
        tasks = set()
        while not self.stop.is_set():
            await self.sem.acquire()
            t = now_ms()
            ids = [f"m{self.n + k}" for k in range(BATCH)]
            due = [t + 500 + (self.n + k) % 20 * 100 for k in range(BATCH)]
            self.n += BATCH
            task = asyncio.create_task(self._batch(ids, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(SEND_PERIOD_S)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def consume_loop(self, until: asyncio.Event) -> None:
        from cluster import errors as E
        from cluster.client import Consumer

        async with Consumer(self.resolver, SUBJECT, group="g", wait_ms=300) as c:
            while not until.is_set():
                try:
                    batch = await c.pull()
                except (E.Unavailable, asyncio.TimeoutError):
                    await asyncio.sleep(0.2)
                    continue
                t = now_ms()
                self.receives.extend({"id": m.id, "t": t, "deliver_at": m.deliver_at_ms} for m in batch)
                try:
                    await c.ack(batch)
                except E.Unavailable:
                    pass

    def acked(self) -> set[str]:
        return {s["id"] for s in self.sends if s["result"] == "OK"}


def log_size(p: Path | None) -> int:
    return p.stat().st_size if p and p.exists() else 0


async def run(net: dict, root: Path) -> dict:
    from cluster.client import Producer
    from cluster.devcluster import LocalCluster, wait_until
    from cluster.discovery import MetaResolver
    from tests.chaos.netns import partition_from_description

    addr = net["addresses"]
    delay_names = ["delay-1", "delay-2"]
    hosts = {"meta-1": addr["core"], "realtime-1": addr["core"], **{d: addr[d] for d in delay_names}}
    prefixes = {d: ["ip", "netns", "exec", net["names"][d]] for d in delay_names}
    result: dict = {"net": net, "events": []}

    def event(what: str, **kw) -> None:
        result["events"].append({"t": now_ms(), "what": what, **kw})

    def cut(member: str, down: bool) -> None:
        partition_from_description(net, member, down=down)
        event("partition" if down else "heal", member=member)

    cluster = LocalCluster(root, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                           lease_ttl_ms=2000, hosts=hosts, prefixes=prefixes)
    cluster.start()
    # for the test's clean-up if this driver is killed: every PID with its command line
    (root / "pids.json").write_text(json.dumps(
        [n.proc.pid for n in cluster.meta + cluster.nodes if n.proc]
        + [m.proc.pid for m in (cluster.etcd.members if cluster.etcd else []) if m.proc]))
    try:
        await asyncio.to_thread(cluster.wait_registered)
        master = await cluster.wait_master("delay", timeout_s=WAIT_S_MAX)
        slave = next(d for d in delay_names if d != master)
        node = {n.name: n for n in cluster.delay}
        await cluster.wait_caught_up_slave(slave, "delay", timeout_s=WAIT_S_MAX)
        event("start", master=master, slave=slave,
              pids={n.name: n.proc.pid for n in cluster.meta + cluster.nodes})
        resolver = MetaResolver(cluster.meta_addresses, refresh_ms=500)
        traffic = Traffic(resolver)
        consumers_done = asyncio.Event()
        sender = asyncio.create_task(traffic.send_loop())
        consumer = asyncio.create_task(traffic.consume_loop(consumers_done))
        try:
            await asyncio.sleep(3.0)

            # ---------------- phase A: the master's namespace is cut off from everything
            probe_out, probe_ready = root / "probe.json", root / "probe.ready"
            probe_proc = subprocess.Popen(
                ["ip", "netns", "exec", net["names"][master], sys.executable, "-m", "tests.chaos.partition_driver",
                 "probe", "--target", node[master].address, "--duration", str(MASTER_PARTITION_S + 1.5),
                 "--ready", str(probe_ready), "--out", str(probe_out)],
                cwd=Path(__file__).resolve().parents[2], stdout=open(root / "probe.log", "ab"),
                stderr=subprocess.STDOUT, start_new_session=True)
            try:
                await wait_until(lambda: asyncio.sleep(0, probe_ready.exists()), 30, "the probe to start")
                await asyncio.sleep(0.5)  # a few probe sends answered while still connected
                old_log_at = log_size(node[master].log_path)
                cut(master, True)
                t_cut = now_ms()

                async def slave_is_master():
                    st = (await cluster.statuses("delay")).get(slave, {})
                    return st.get("master")
                await wait_until(slave_is_master, WAIT_S_MAX, f"{slave} to take over")
                event("failover", new_master=slave, failover_ms=now_ms() - t_cut)
                # hold the cut until the new master delivered what was acknowledged before it
                before = {x["id"] for x in traffic.sends if x["result"] == "OK" and x["answered"] < t_cut}

                async def delivered():
                    return before <= {x["id"] for x in traffic.receives}
                try:
                    await wait_until(delivered, WAIT_S_MAX, "deliveries during the partition")
                except TimeoutError:
                    event("not_delivered_during_partition")  # the test sees it in the numbers
                await asyncio.sleep(max(0.0, MASTER_PARTITION_S - (now_ms() - t_cut) / 1000))
                cut(master, False)
                t_heal = now_ms()
                await asyncio.to_thread(probe_proc.wait, 30)
            finally:
                if probe_proc.poll() is None:
                    probe_proc.kill()
                    probe_proc.wait(10)
            await cluster.wait_caught_up_slave(master, "delay", timeout_s=WAIT_S_MAX)
            event("rejoined", node=master, rejoin_ms=now_ms() - t_heal)
            old_log = node[master].log_path.read_text(errors="replace")[old_log_at:] if node[master].log_path else ""
            result["phase_a"] = {
                "master": master, "slave": slave, "t_cut": t_cut, "t_heal": t_heal,
                "probe": json.loads(probe_out.read_text()) if probe_out.exists() else None,
                "old_master_truncated": [ln for ln in old_log.splitlines() if "truncated" in ln][:5],
                "old_master_became": [ln for ln in old_log.splitlines() if "became" in ln][:10],
            }
            # probe messages the old master stored but never got acknowledged: gone after the truncation?
            probe_ids = [s["id"] for s in (result["phase_a"]["probe"] or {}).get("sends", [])]
            lookups = {}
            async with Producer(resolver, retries_max=10) as p:
                for pid in probe_ids:
                    try:
                        lookups[pid] = (await p.lookup(pid)).status
                    except Exception as e:  # noqa: BLE001
                        lookups[pid] = f"error:{type(e).__name__}"
            result["phase_a"]["probe_lookups"] = lookups
            await asyncio.sleep(2.0)

            # ---------------- phase B: the slave (the old master) is cut off; the master must not ack alone
            master_b, slave_b = slave, master
            cut(slave_b, True)
            t_cut_b = now_ms()
            await asyncio.sleep(SLAVE_PARTITION_S)
            cut(slave_b, False)
            t_heal_b = now_ms()
            await cluster.wait_caught_up_slave(slave_b, "delay", timeout_s=WAIT_S_MAX)
            event("rejoined", node=slave_b, rejoin_ms=now_ms() - t_heal_b)
            result["phase_b"] = {"master": master_b, "slave": slave_b, "t_cut": t_cut_b, "t_heal": t_heal_b,
                                 "master_status": (await cluster.statuses("delay")).get(master_b, {})}
            await asyncio.sleep(3.0)  # sends succeed again
        finally:
            traffic.stop.set()
            await sender
        # ---------------- drain: every acknowledged message must arrive
        acked = traffic.acked()
        deadline = time.monotonic() + DRAIN_S_MAX
        while time.monotonic() < deadline and not acked <= {r["id"] for r in traffic.receives}:
            await asyncio.sleep(0.3)
        consumers_done.set()
        await consumer
        await traffic.channels.close()
        await resolver.close()
        # replicas after the run: the old master's logs must be byte-identical prefixes of the master's
        # (its divergent suffix cut), or the other way round while the slave trails by an instant
        await asyncio.sleep(1.0)
        from tests.helpers.logs import log_bytes
        prefix_ok = {}
        for lg in ("messages", "dispatch"):
            x, y = (log_bytes(n.data_dir / lg) for n in cluster.delay)
            short, long_ = sorted((x, y), key=len)
            prefix_ok[lg] = {"identical_prefix": long_[: len(short)] == short, "bytes": [len(x), len(y)]}
        result["replica_logs"] = prefix_ok
        result["sends"] = traffic.sends
        result["receives"] = traffic.receives
        result["final_master"] = await cluster.wait_master("delay", timeout_s=WAIT_S_MAX)
    finally:
        cluster.stop()
        for n in delay_names:  # never leave a link down behind
            try:
                partition_from_description(net, n, down=False)
            except Exception:  # noqa: BLE001
                pass
    result["logs"] = {n.name: str(n.log_path) for n in cluster.meta + cluster.nodes}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--net", required=True, help="JSON file from Netns.describe()")
    r.add_argument("--root", required=True)
    r.add_argument("--out", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--target", required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "probe":
        asyncio.run(probe(a.target, a.duration, Path(a.ready), Path(a.out)))
        return
    net = json.loads(Path(a.net).read_text())
    res = asyncio.run(run(net, Path(a.root)))
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
