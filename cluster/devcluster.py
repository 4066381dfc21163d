"""A local cluster of real node processes on 127.0.0.1: for the demo, ``hourglass dev up``,
tests and benchmarks.

Placement (network-partition tests, ``tests/chaos/netns.py``): ``hosts`` gives a process
(by name: ``meta-1``, ``realtime-1``, ``delay-2`` ...) its bind/advertise address instead of
127.0.0.1 and ``prefixes`` a command prefix such as ``["ip", "netns", "exec", ns]``; the
prefix execs, so the PID stays the node's and stop/kill by PID still work.

Every process is started with a ready file and stopped by its PID (SIGTERM, then
SIGKILL after ``stop_timeout_s``), never by name. ``cluster.json`` in the data root
lists the addresses (and the PID of every process) so CLI commands find the cluster without
flags. The root is resolved to an absolute path once, in ``LocalCluster.__init__``: the
processes run with the repository as their working directory, whatever the caller's is.

Supervision (opt-in; ``hourglass dev up`` uses it, the demo and tests do not): ``Supervisor``
restarts a process that died on its own data directory after ``restart_backoff_ms``, like the
Helm deployment's pods, at most ``restarts_max`` times per ``restart_window_ms`` (then it is
left down and the rest keep serving). It never blocks on a start: ``tick(now_ms)`` notices
deaths, restarts that are due and ready files that appeared, and returns one log line per
event. ``RestartBudget`` holds the rule (pure, time as an argument)::

    budget = RestartBudget(RestartPolicy(restart_backoff_ms=1000, restarts_max=2, restart_window_ms=60_000))
    budget.restart_at_ms("delay-1", died_ms=5_000)   # -> 6_000
    budget.restarted("delay-1", 6_000); budget.restarted("delay-1", 9_000)
    budget.restart_at_ms("delay-1", died_ms=10_000)  # -> None: 2 restarts within 60 s, left down
    budget.restart_at_ms("delay-1", died_ms=66_001)  # -> 67_001: the first one left the window
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.certs import ETCD_MEMBER_PREFIX, dev_security
from cluster.errors import Unavailable
from cluster.etcdproc import EtcdCluster, EtcdFiles
from cluster.files import DATA_DIR_MODE, DATA_MODE, write_secret
from cluster.ports import free_port
from cluster.process import SERVER_UMASK
from cluster.security import ClientSecurity, SecuritySettings

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
ELECTION_WAIT_S = 30.0  # wait_master / wait_caught_up_slave give up after this long


async def wait_until(pred, timeout_s: float, what: str):
    """Poll the async predicate every 100 ms until it returns something true (returned)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class NodeProcess:
    name: str
    role: str
    data_dir: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"  # bind and advertise address
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", ns]; must exec

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ready_file(self) -> Path:
        return self.data_dir.parent / f"{self.name}.ready"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "cluster.cli", "node", "--role", self.role, "--node-id", self.name,
                "--data-dir", str(self.data_dir), "--host", self.host, "--port", str(self.port),
                "--ready-file", str(self.ready_file), *self.args]

    def start(self) -> None:
        self.data_dir.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        if self.ready_file.exists():
            self.ready_file.unlink()
        self.log_path = self.data_dir.parent / f"{self.name}.log"
        env = dict(os.environ)
        env.update(self.env)
        # the log is owner-only like the data; the child starts with umask 077 (``hourglass node``
        # sets it again itself: one started by hand or by Kubernetes gets it too)
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, DATA_MODE), "ab") as logf:
            self.proc = subprocess.Popen([*self.prefix, *self.command()], stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, cwd=Path(__file__).resolve().parent.parent, start_new_session=True,
                                         umask=SERVER_UMASK)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise Unavailable(f"{self.name} exited with {self.proc.returncode}; log:\n{self.tail_log()}")
            time.sleep(0.02)
        raise Unavailable(f"{self.name} not ready after {timeout_s}s; log:\n{self.tail_log()}")

    def tail_log(self, n: int = 40) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen process cannot handle SIGTERM
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class MetaProcess(NodeProcess):
    """A meta server process (``hourglass metaserver``); same start/stop/kill by PID as a node."""

    etcd_endpoints: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "cluster.cli", "metaserver", "--host", self.host, "--port", str(self.port),
                "--etcd-endpoints", ",".join(self.etcd_endpoints), "--ready-file", str(self.ready_file), *self.args]


# ---------------------------------------------------------------------- the shape of a dev cluster

DELAY_GROUPS_MAX = 8      # `hourglass dev up --delay-groups`
REALTIME_GROUPS_MAX = 8   # `hourglass dev up --realtime-groups`
REPLICAS_MAX = 5          # members of one group (`--replicas`, `--realtime-replicas`)
NODES_MAX = 24            # node processes of one local cluster, all groups together


@dataclass(frozen=True)
class ClusterShape:
    """How many groups of each kind and how many members per group (``hourglass dev up``, ``dev
    chaos`` reads it back from the cluster, the benchmarks that start a cluster). Pure.

    ``replicas`` is the size of every delay group (2+: master and slaves, by election);
    ``realtime_replicas`` that of every real-time group (default 1: one unreplicated node per
    group, docs/cli.md says why)."""

    delay_groups: int = 1
    realtime_groups: int = 1
    replicas: int = 1
    realtime_replicas: int = 1

    def problem(self, *, meta: bool = True, ack_mode: str = "async") -> tuple[str, str] | None:
        """(option, one-line reason) of the first thing wrong with this shape, or None."""
        bounds = (("--delay-groups", self.delay_groups, DELAY_GROUPS_MAX),
                  ("--realtime-groups", self.realtime_groups, REALTIME_GROUPS_MAX),
                  ("--replicas", self.replicas, REPLICAS_MAX),
                  ("--realtime-replicas", self.realtime_replicas, REPLICAS_MAX))
        for option, value, top in bounds:
            if not 1 <= value <= top:
                return option, f"{value} is not in 1..{top}"
        if self.nodes > NODES_MAX:
            return "--delay-groups", (f"{self.nodes} node processes ({self.delay_groups}x{self.replicas} delay + "
                                      f"{self.realtime_groups}x{self.realtime_replicas} real-time); at most "
                                      f"{NODES_MAX} on one machine")
        if not meta:
            elections = "more than one replica needs --meta (elections run through the meta servers)"
            if self.replicas > 1:
                return "--replicas", elections
            if self.realtime_replicas > 1:
                return "--realtime-replicas", elections
            if self.delay_groups > 1 or self.realtime_groups > 1:
                option = "--delay-groups" if self.delay_groups > 1 else "--realtime-groups"
                return option, ("more than one group needs --meta (the meta servers route subjects to groups "
                                "and clients find the groups there)")
        if ack_mode == "sync" and self.replicas < 2:
            return "--ack-mode", "sync needs a slave to acknowledge: use --replicas 2 or more"
        return None

    @property
    def nodes(self) -> int:
        return self.delay_groups * self.replicas + self.realtime_groups * self.realtime_replicas

    def cluster_kwargs(self) -> dict:
        """The ``LocalCluster`` arguments of this shape."""
        return {"n_delay": self.delay_groups * self.replicas, "delay_replicas": self.replicas,
                "n_realtime": self.realtime_groups * self.realtime_replicas,
                "realtime_replicas": self.realtime_replicas}

    def describe(self) -> str:
        def kind(n: int, r: int, what: str) -> str:
            return f"{n} {what} group(s) of {r} node(s)"
        return (kind(self.delay_groups, self.replicas, "delay") + ", "
                + kind(self.realtime_groups, self.realtime_replicas, "real-time"))

    def as_dict(self) -> dict:
        return {"delay_groups": self.delay_groups, "realtime_groups": self.realtime_groups,
                "replicas": self.replicas, "realtime_replicas": self.realtime_replicas}


def add_shape_arguments(parser) -> None:
    """``--delay-groups --realtime-groups --replicas --realtime-replicas`` on an argparse parser
    (the benchmarks that start a cluster); ``shape_from_args`` reads them back, checked."""
    parser.add_argument("--delay-groups", type=int, default=1, help=f"delay groups (1..{DELAY_GROUPS_MAX})")
    parser.add_argument("--realtime-groups", type=int, default=1, help=f"real-time groups (1..{REALTIME_GROUPS_MAX})")
    parser.add_argument("--replicas", type=int, default=1,
                        help=f"members of each delay group (1..{REPLICAS_MAX}; 2+: master and slaves)")
    parser.add_argument("--realtime-replicas", type=int, default=1,
                        help=f"members of each real-time group (1..{REPLICAS_MAX})")


def shape_from_args(parser, args, *, meta: bool = True, ack_mode: str = "async") -> ClusterShape:
    shape = ClusterShape(args.delay_groups, args.realtime_groups, args.replicas, args.realtime_replicas)
    bad = shape.problem(meta=meta, ack_mode=ack_mode)
    if bad is not None:
        parser.error(f"{bad[0]}: {bad[1]}")
    return shape


class LocalCluster:
    """``n_delay`` delay nodes and ``n_realtime`` real-time nodes, each its own process.

    With ``meta=True`` (or ``n_meta > 0``) it also starts a real etcd (``cluster.etcdproc``,
    ``etcd_members`` members; or uses ``etcd_endpoints`` given) and ``n_meta`` meta
    servers; every node then gets its own group (``delay-1``, ``realtime-1`` ...),
    registers through the meta servers and discovers through them (no static lists).
    """

    def __init__(self, root: str | os.PathLike, *, n_delay: int = 1, n_realtime: int = 1,
                 env: dict[str, str] | None = None, delay_args: list[str] | None = None,
                 realtime_args: list[str] | None = None, meta: bool = False, n_meta: int = 0,
                 etcd_members: int = 1, etcd_endpoints: list[str] | None = None,
                 delay_replicas: int = 1, ack_mode: str = "async", lease_ttl_ms: int | None = None,
                 realtime_replicas: int = 1, hosts: dict[str, str] | None = None,
                 prefixes: dict[str, list[str]] | None = None, secure: bool = False) -> None:
        self.root = Path(root).resolve()  # children run in the repository, not the caller's cwd
        self.ack_mode = ack_mode
        self.root.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        # secure: mutual TLS on every port, tokens checked (docs/security.md); the material
        # (a CA, the nodes' certificate, a client certificate, an admin token) is made here
        self.security = dev_security(self.root, hosts=sorted({"127.0.0.1", "localhost", *(hosts or {}).values()})) \
            if secure else None
        self.env = {**(self.security.node_env() if self.security else {}), **(env or {})}
        n_meta = n_meta or (1 if meta else 0)
        self.etcd = None
        self.etcd_endpoints = list(etcd_endpoints or [])
        if n_meta and not self.etcd_endpoints:
            # secure: etcd serves mutual TLS too (client and peer) on its own CA: only the meta
            # servers' etcd-client certificate opens it, never a node's or a client's
            etcd_tls = EtcdFiles(self.security.etcd_ca, self.security.etcd_member_cert,
                                 self.security.etcd_member_key, peer_cn=ETCD_MEMBER_PREFIX + "dev") \
                if self.security else None
            self.etcd = EtcdCluster(self.root / "etcd", members=etcd_members, tls=etcd_tls)
            self.etcd_endpoints = self.etcd.endpoints
        hosts, prefixes = hosts or {}, prefixes or {}

        def place(name: str) -> dict:
            return {"host": hosts.get(name, "127.0.0.1"), "prefix": list(prefixes.get(name, []))}

        meta_env = dict(self.env)
        if self.security is not None and self.etcd is not None:
            meta_env.update(self.security.meta_etcd_env())
        self.meta = [MetaProcess(f"meta-{i + 1}", "meta", self.root / f"meta-{i + 1}", free_port(), dict(meta_env),
                                 etcd_endpoints=self.etcd_endpoints, **place(f"meta-{i + 1}"))
                     for i in range(n_meta)]
        self.realtime = [NodeProcess(f"realtime-{i + 1}", "realtime", self.root / f"realtime-{i + 1}", free_port(),
                                     dict(self.env), list(realtime_args or []), **place(f"realtime-{i + 1}"))
                         for i in range(n_realtime)]
        self.delay = [NodeProcess(f"delay-{i + 1}", "delay", self.root / f"delay-{i + 1}", free_port(),
                                  dict(self.env), list(delay_args or []), **place(f"delay-{i + 1}"))
                      for i in range(n_delay)]
        # group name -> member names (meta mode; static mode: every node is its own group)
        self.group_of: dict[str, str] = {n.name: n.name for n in self.realtime + self.delay}
        if self.meta:
            for i, n in enumerate(self.realtime):
                # realtime_replicas > 1: real-time groups of a master and slaves (node/replication/realtime.py)
                group = n.name if realtime_replicas <= 1 else f"realtime-g{i // realtime_replicas + 1}"
                n.args += ["--meta", ",".join(self.meta_addresses), "--group", group]
                self.group_of[n.name] = group
                if realtime_replicas > 1:
                    n.env.update({"HOURGLASS_REPLICATED": "true", "HOURGLASS_ACK_MODE": ack_mode})
            for i, n in enumerate(self.delay):
                # delay_replicas > 1: groups of a master and slaves, roles by election (node/replication/)
                group = n.name if delay_replicas <= 1 else f"delay-g{i // delay_replicas + 1}"
                n.args += ["--meta", ",".join(self.meta_addresses), "--group", group]
                self.group_of[n.name] = group
                if delay_replicas > 1:
                    n.env.update({"HOURGLASS_REPLICATED": "true", "HOURGLASS_ACK_MODE": ack_mode})
            if lease_ttl_ms:
                for n in self.delay + self.realtime:
                    n.env["HOURGLASS_META_LEASE_TTL_MS"] = str(lease_ttl_ms)
        else:
            rt = ",".join(n.address for n in self.realtime)
            dl = ",".join(n.address for n in self.delay)
            for n in self.delay:
                n.args += ["--realtime-nodes", rt]
            for n in self.realtime:
                n.args += ["--delay-nodes", dl]

    def node_security(self) -> ClientSecurity:
        """Credentials of the harness itself: the nodes' certificate when secure (it may do
        anything), plaintext otherwise."""
        if self.security is None:
            return ClientSecurity(SecuritySettings())
        return ClientSecurity(SecuritySettings(tls_ca_file=self.security.ca, tls_cert_file=self.security.node_cert,
                                               tls_key_file=self.security.node_key))

    def client_security(self, token_file: Path | None = None, **settings) -> ClientSecurity:
        """Credentials of a client: the client certificate and a token (the admin token unless
        given); plaintext when the cluster is not secure."""
        if self.security is None:
            return ClientSecurity(SecuritySettings())
        fields = {"tls_ca_file": self.security.ca, "tls_cert_file": self.security.client_cert,
                  "tls_key_file": self.security.client_key,
                  "token_file": token_file or self.security.admin_token_file}
        return ClientSecurity(SecuritySettings(**(fields | settings)))

    def groups(self) -> dict[str, dict[str, list[str]]]:
        """role -> group name -> member names, as the nodes were told (``cluster.json`` "groups")."""
        out: dict[str, dict[str, list[str]]] = {"delay": {}, "realtime": {}}
        for role, nodes in (("delay", self.delay), ("realtime", self.realtime)):
            for n in nodes:
                out[role].setdefault(self.group_of[n.name], []).append(n.name)
        return out

    @property
    def meta_addresses(self) -> list[str]:
        return [m.address for m in self.meta]

    @property
    def nodes(self) -> list[NodeProcess]:
        return self.realtime + self.delay

    # ------------------------------------------------------------------ roles (replicated groups)

    async def statuses(self, role: str = "delay") -> dict[str, dict]:
        """Admin Status of every running node of ``role``: name -> JSON stats plus ``master``."""
        from cluster.proto import hourglass_pb2 as pb
        from cluster.transport import Channels

        ch = Channels(self.node_security())
        out: dict[str, dict] = {}
        try:
            for n in (self.delay if role == "delay" else self.realtime):
                if n.running:
                    try:
                        r = await ch.admin(n.address).Status(pb.StatusRequest(), timeout=2)
                        out[n.name] = json.loads(r.json) | {"master": r.master}
                    except Exception:  # a node that does not answer is simply not listed
                        pass
        finally:
            await ch.close()
        return out

    async def wait_master(self, role: str = "delay", timeout_s: float = ELECTION_WAIT_S) -> str:
        """Name of the one master once every other running node of ``role`` is its slave."""
        async def find():
            st = await self.statuses(role)
            ms = [k for k, v in st.items() if v["master"]]
            running = [n for n in (self.delay if role == "delay" else self.realtime) if n.running]
            slaves = all(v.get("mode") == "slave" for k, v in st.items() if k not in ms)
            return ms[0] if len(ms) == 1 and slaves and len(st) == len(running) else None
        return await wait_until(find, timeout_s, f"one {role} master")

    async def wait_masters(self, role: str = "delay", timeout_s: float = ELECTION_WAIT_S) -> dict[str, str]:
        """group -> its one master, once every group of ``role`` has one and its other running
        members are its slaves (``wait_master`` for a cluster of several groups)."""
        groups = self.groups()[role]

        async def find():
            st = await self.statuses(role)
            out = {}
            for group, members in groups.items():
                running = [m for m in members if next(n for n in self.nodes if n.name == m).running]
                ms = [m for m in running if st.get(m, {}).get("master")]
                if len(ms) != 1 or not all(m in st for m in running) \
                        or not all(st[m].get("mode") == "slave" for m in running if m != ms[0]):
                    return None
                out[group] = ms[0]
            return out
        return await wait_until(find, timeout_s, f"one master in every {role} group")

    async def wait_in_sync(self, role: str = "delay", timeout_s: float = ELECTION_WAIT_S) -> None:
        """Block until every running member of every ``role`` group is in its group's in-sync set
        (meta ``Leader``). A slave joins only after its fetch reached the master's log end and the
        master's next role round wrote it; until then it may not campaign, so a test that kills
        a master right after start-up waits here first."""
        from cluster.discovery import MetaClient
        from cluster.proto import meta_pb2 as mpb

        groups = self.groups()[role]
        meta = MetaClient(self.meta_addresses, timeout_s=5, security=self.node_security())
        try:
            async def all_in():
                for group, members in groups.items():
                    running = {m for m in members if next(n for n in self.nodes if n.name == m).running}
                    lr = await meta.call("Leader", mpb.LeaderRequest(role=role, group=group))
                    if not running <= set(lr.in_sync):
                        return False
                return True
            await wait_until(all_in, timeout_s, f"every running {role} member in its in-sync set")
        finally:
            await meta.close()

    async def wait_caught_up_slave(self, name: str, role: str = "delay", timeout_s: float = ELECTION_WAIT_S) -> None:
        async def ok():
            st = (await self.statuses(role)).get(name, {})
            return st.get("mode") == "slave" and st.get("replication_lag_bytes", 1) == 0
        await wait_until(ok, timeout_s, f"{name} as a caught-up slave")

    def start(self) -> "LocalCluster":
        try:
            if self.etcd is not None:
                self.etcd.start()
            for m in self.meta:
                m.start()
            for m in self.meta:
                m.wait_ready()
            for n in self.nodes:
                n.start()
            for n in self.nodes:
                n.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.write_cluster_file()
        return self

    def write_cluster_file(self) -> None:
        """``cluster.json`` (addresses, PIDs and where the client credentials are), replaced
        atomically (a reader never sees half of it) and owner-only: another local user can
        neither read it nor plant a temporary file that becomes it."""
        write_secret(self.root / "cluster.json", json.dumps(self.describe(), indent=2).encode())

    def wait_registered(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every running node is listed by the meta servers (meta mode)."""
        if not self.meta:
            return
        import asyncio

        from cluster.discovery import MetaResolver

        want = {n.address for n in self.nodes if n.running}

        async def listed() -> set[str]:
            r = MetaResolver(self.meta_addresses, security=self.node_security())
            try:
                await r.load()
                return set(r.delay) | set(r.realtime)
            finally:
                await r.close()

        def run_listed() -> set[str]:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(listed())
            # called from async code (a test): run the check on its own loop in a thread
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(1) as ex:
                return ex.submit(asyncio.run, listed()).result()

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if want <= run_listed():
                    return
            except Unavailable:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"nodes not registered after {timeout_s}s")
            time.sleep(0.1)

    def describe(self) -> dict:
        out = {"delay": [n.address for n in self.delay], "realtime": [n.address for n in self.realtime],
               "pids": {n.name: n.proc.pid for n in self.meta + self.nodes if n.proc},
               "processes": {n.name: {"role": n.role, "address": n.address, "pid": n.proc.pid if n.proc else None}
                             for n in self.meta + self.nodes}}
        for m in self.etcd.members if self.etcd is not None else []:
            out["processes"][m.name] = {"role": "etcd", "address": m.endpoint, "pid": m.proc.pid if m.proc else None}
        out["groups"] = self.groups()
        out["ack_mode"] = self.ack_mode  # of the replicated groups (a group of one member answers alone)
        if self.meta:
            out["meta"] = self.meta_addresses
            out["etcd"] = self.etcd_endpoints
        if self.security is not None:
            out["security"] = self.security.cluster_file_entry()
        return out

    def restart(self, node: NodeProcess) -> None:
        node.stop()
        node.start()
        node.wait_ready()

    def stop(self) -> None:
        for n in self.nodes + self.meta:
            try:
                n.stop()
            except Exception:  # keep stopping the others
                n.kill()
        if self.etcd is not None:
            self.etcd.stop()
        cj = self.root / "cluster.json"
        if cj.exists():
            cj.unlink()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------- supervision (hourglass dev up)


@dataclass(frozen=True)
class RestartPolicy:
    """How ``Supervisor`` restarts a dead process (the pods' ``restartPolicy: Always`` of the Helm chart)."""

    # after a death, wait this long, then start it on its own data. Longer than the nodes' meta lease
    # (``hourglass dev up`` uses 2000 ms): a master restarted sooner re-registers under its own id and
    # wins its group back before its slave can take over
    restart_backoff_ms: int = 3000
    restarts_max: int = 5               # at most this many restarts of one process ...
    restart_window_ms: int = 60_000     # ... within this window; beyond, it is left down (logged)
    ready_timeout_ms: int = 30_000      # a restarted process that writes no ready file by then is killed
    role_poll_ms: int = 1000            # how often the nodes' roles are read (takeovers are logged)

    def __post_init__(self) -> None:
        assert self.restart_backoff_ms >= 0 and self.restarts_max >= 0 and self.restart_window_ms > 0


class RestartBudget:
    """Pure: when may a process restart, given its recent restarts. Time comes in as ``now_ms``."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._restarts_ms: dict[str, deque[int]] = {}

    def recent(self, name: str, now_ms: int) -> int:
        """Restarts of ``name`` within the window ending at ``now_ms``."""
        q = self._restarts_ms.setdefault(name, deque())
        while q and q[0] <= now_ms - self.policy.restart_window_ms:
            q.popleft()
        return len(q)

    def restart_at_ms(self, name: str, died_ms: int) -> int | None:
        """When to restart ``name``, dead since ``died_ms``; None once it used up its restarts."""
        if self.recent(name, died_ms) >= self.policy.restarts_max:
            return None
        return died_ms + self.policy.restart_backoff_ms

    def restarted(self, name: str, now_ms: int) -> None:
        q = self._restarts_ms.setdefault(name, deque())
        assert not q or q[-1] <= now_ms, "restarts are recorded in time order"
        q.append(now_ms)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"code={code} signal={signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code={code}"


class Supervisor:
    """Keeps the processes of a started ``LocalCluster`` (meta servers, nodes, etcd members) running.

    ``tick(now_ms)`` never blocks on a start; it returns the log lines of what happened (plain text:
    process logs may hold anything, so the caller must not read them as markup). ``cluster.json``
    is rewritten after every restart, so its PIDs stay those of the running processes.
    """

    LOG_TAIL_LINES = 10

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy = RestartPolicy()) -> None:
        self.cluster = cluster
        self.policy = policy
        self.budget = RestartBudget(policy)
        self.restart_at_ms: dict[str, int] = {}   # dead, restart scheduled
        self.starting_ms: dict[str, int] = {}     # restarted, waiting for its ready file
        self.given_up: set[str] = set()
        self.restarts = 0
        self.roles: dict[str, str] = {}           # node -> "master"/"slave" last seen

    def processes(self) -> list:
        etcd = self.cluster.etcd.members if self.cluster.etcd is not None else []
        return [*etcd, *self.cluster.meta, *self.cluster.nodes]

    @staticmethod
    def _ready(p) -> bool:
        ready_file = getattr(p, "ready_file", None)  # an etcd member has none: running is ready
        return p.running and (ready_file is None or ready_file.exists())

    def tick(self, now_ms: int) -> list[str]:
        out: list[str] = []
        restarted = False
        for p in self.processes():
            if p.name in self.given_up:
                continue
            if p.name in self.starting_ms:
                if self._ready(p):
                    out.append(f"{p.name} restarted pid={p.proc.pid} "
                               f"ready_ms={now_ms - self.starting_ms.pop(p.name)}")
                    restarted = True
                    continue
                if p.running and now_ms - self.starting_ms[p.name] > self.policy.ready_timeout_ms:
                    out.append(f"{p.name} not ready after {self.policy.ready_timeout_ms} ms; killing pid={p.proc.pid}")
                    p.kill()
                if p.running:
                    continue
                del self.starting_ms[p.name]
            if p.running:
                continue
            if p.name not in self.restart_at_ms:
                at = self.budget.restart_at_ms(p.name, now_ms)
                code = p.proc.returncode if p.proc is not None else None
                if at is None:
                    self.given_up.add(p.name)
                    out.append(f"{p.name} exited {_exit_text(code)}; restarted {self.policy.restarts_max} times "
                               f"within {self.policy.restart_window_ms} ms: left down, the others keep serving")
                else:
                    self.restart_at_ms[p.name] = at
                    out.append(f"{p.name} exited {_exit_text(code)}; restarting on its data in "
                               f"{at - now_ms} ms (restart {self.budget.recent(p.name, now_ms) + 1} of at most "
                               f"{self.policy.restarts_max} per {self.policy.restart_window_ms} ms)")
                tail = p.tail_log(self.LOG_TAIL_LINES)
                if tail:
                    out.append(f"{p.name} log tail:\n{tail}")
            elif now_ms >= self.restart_at_ms[p.name]:
                del self.restart_at_ms[p.name]
                self.budget.restarted(p.name, now_ms)
                self.restarts += 1
                try:
                    p.start()
                except OSError as e:  # counted as a restart: the next tick sees it dead again
                    out.append(f"{p.name} restart failed: {e}")
                    continue
                self.starting_ms[p.name] = now_ms
        if restarted:
            self.cluster.write_cluster_file()
        return out

    def role_changes(self, statuses: dict[str, dict]) -> list[str]:
        """Log lines for nodes whose mode changed (``LocalCluster.statuses`` output)."""
        out = []
        for name, st in sorted(statuses.items()):
            mode = "master" if st.get("master") else st.get("mode", "slave")
            was = self.roles.get(name)
            if was != mode:
                self.roles[name] = mode
                if was is not None or mode == "master":
                    out.append(f"{name} is now {mode} of group {st.get('group', '?')} "
                               f"epoch={st.get('election_epoch', st.get('epoch', '?'))}"
                               + (f" (was {was})" if was else ""))
        return out

    async def run(self, stop, log: Callable[[str], None], *, poll_s: float = 0.2) -> None:
        """Tick every ``poll_s`` and log role changes every ``role_poll_ms`` until ``stop`` (an
        ``asyncio.Event``) is set. Statuses that do not answer leave the last known role."""
        import asyncio

        next_roles_ms = 0
        groups = self.cluster.groups()
        # roles worth following: the delay nodes when there are several, the real-time ones in replicated groups
        polled = [role for role, several in (("delay", len(self.cluster.delay) > 1),
                                             ("realtime", any(len(m) > 1 for m in groups["realtime"].values())))
                  if several]
        while not stop.is_set():
            now_ms = time.monotonic_ns() // 1_000_000
            for line in self.tick(now_ms):
                log(line)
            if now_ms >= next_roles_ms and polled:
                next_roles_ms = now_ms + self.policy.role_poll_ms
                for role in polled:
                    for line in self.role_changes(await self.cluster.statuses(role)):
                        log(line)
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
