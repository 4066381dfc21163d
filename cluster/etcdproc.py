"""A real etcd for tests and ``hourglass dev up``: local processes or a Docker container.

``EtcdCluster(root, members=1)`` starts ``/usr/bin/etcd`` (Debian's etcd-server)
as one process per member on free 127.0.0.1 ports; ``members=3`` makes a real
three-member raft cluster. Every process is stopped by its PID (SIGTERM, then
SIGKILL), never by name; ``kill(i)`` SIGKILLs one member.

``EtcdContainer`` runs the same binary in a container through testcontainers. No
image is pulled: ``build_image()`` makes one with ``docker import`` from a tar
holding the binary and the two libraries it links (libc and the loader), and the
container uses host networking, so its ports are 127.0.0.1 ports like the
process path. Needs a Docker daemon (``scripts/dockerd.sh start``) and
``TESTCONTAINERS_RYUK_DISABLED=true`` (the reaper image cannot be pulled).

Both expose ``endpoints`` (``["127.0.0.1:port", ...]``) and ``wait_ready()``,
which polls each member's ``/health`` over HTTP with a deadline.

    with EtcdCluster(tmp_path / "etcd", members=3) as etcd:
        client = EtcdClient(etcd.endpoints)
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import ssl
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster.errors import Unavailable
from cluster.files import DATA_DIR_MODE, DATA_MODE
from cluster.ports import free_port
from cluster.process import SERVER_UMASK

ETCD_BINARY = os.environ.get("HOURGLASS_ETCD_BINARY", "/usr/bin/etcd")
ETCD_IMAGE = "hourglass/etcd-local:3.4"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# Short raft timers: elections settle in well under a second on 127.0.0.1, and the
# minimum lease TTL etcd grants (ceil(1.5 x election timeout)) drops to 1 s.
HEARTBEAT_MS = 100
ELECTION_MS = 500
# every heartbeat and election write is a new etcd revision: without compaction etcd keeps the
# whole history and reaches its backend quota (2 GiB), after which it refuses every write
# (docs/operations.md, "etcd history"). Keep an hour of history, as the chart does.
AUTO_COMPACTION_RETENTION = "1h"


@dataclass(frozen=True)
class EtcdFiles:
    """Mutual TLS for clients and peers: etcd's own CA (``hourglass certs`` etcd CA: no node or
    client certificate of the cluster is signed by it), and the certificate and key every
    member serves with (and shows its peers). A client must show a certificate of that CA;
    with ``peer_cn`` a peer must also carry that common name (a meta server's etcd-client
    certificate cannot join as a member)."""

    ca: Path
    cert: Path
    key: Path
    peer_cn: str | None = None

    def args(self) -> list[str]:
        return ["--cert-file", str(self.cert), "--key-file", str(self.key), "--trusted-ca-file", str(self.ca),
                "--client-cert-auth",
                "--peer-cert-file", str(self.cert), "--peer-key-file", str(self.key),
                "--peer-trusted-ca-file", str(self.ca), "--peer-client-cert-auth",
                *(["--peer-cert-allowed-cn", self.peer_cn] if self.peer_cn else [])]

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def _member_args(name: str, data_dir: str, client_port: int, peer_port: int, initial_cluster: str,
                 token: str, tls: EtcdFiles | None = None) -> list[str]:
    scheme = "https" if tls else "http"
    return ["--name", name, "--data-dir", data_dir,
            "--listen-client-urls", f"{scheme}://127.0.0.1:{client_port}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{client_port}",
            "--listen-peer-urls", f"{scheme}://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"{scheme}://127.0.0.1:{peer_port}",
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", AUTO_COMPACTION_RETENTION,
            "--log-level", "warn", "--logger", "zap", *(tls.args() if tls else [])]


def healthy(endpoint: str, timeout_s: float = 1.0, tls: EtcdFiles | None = None) -> bool:
    """True when the member answers ``/health`` with health=true (it has a raft leader)."""
    try:
        url = f"{'https' if tls else 'http'}://{endpoint}/health"
        with urllib.request.urlopen(url, timeout=timeout_s, context=tls.ssl_context() if tls else None) as r:
            return json.loads(r.read()).get("health") == "true"
    except Exception:
        return False


@dataclass
class EtcdMember:
    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None
    args: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        # owner-only like a node's data: etcd makes its --data-dir 0700 itself; its files and
        # the log get 0600 from the umask and the mode here
        self.data_dir.parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        log = os.fdopen(os.open(self.data_dir.parent / f"{self.name}.log",
                                os.O_WRONLY | os.O_APPEND | os.O_CREAT, DATA_MODE), "ab")
        self.proc = subprocess.Popen([ETCD_BINARY, *self.args], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, umask=SERVER_UMASK)
        log.close()

    def kill(self) -> None:
        if self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        if not self.running:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail_log(self, n: int = 20) -> str:
        p = self.data_dir.parent / f"{self.name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""


class EtcdCluster:
    """``members`` etcd processes forming one cluster on free 127.0.0.1 ports."""

    def __init__(self, root: str | os.PathLike, *, members: int = 1, tls: EtcdFiles | None = None) -> None:
        if members < 1:
            raise ValueError("members must be >= 1")
        if not Path(ETCD_BINARY).exists():
            raise Unavailable(f"no etcd binary at {ETCD_BINARY} (Debian: apt-get install etcd-server)")
        self.root = Path(root)
        self.tls = tls
        self.members = [EtcdMember(f"etcd-{i + 1}", self.root / f"etcd-{i + 1}", free_port(), free_port())
                        for i in range(members)]
        scheme = "https" if tls else "http"
        initial = ",".join(f"{m.name}={scheme}://127.0.0.1:{m.peer_port}" for m in self.members)
        for m in self.members:
            m.args = _member_args(m.name, str(m.data_dir), m.client_port, m.peer_port, initial,
                                  f"hourglass-{self.members[0].peer_port}", tls)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> "EtcdCluster":
        try:
            for m in self.members:
                m.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for m in self.members:
            if not m.running and m.proc is not None:
                continue  # a killed member stays down until start_member()
            while not healthy(m.endpoint, tls=self.tls):
                if m.proc is not None and m.proc.poll() is not None:
                    raise Unavailable(f"{m.name} exited with {m.proc.returncode}:\n{m.tail_log()}")
                if time.monotonic() > deadline:
                    raise Unavailable(f"{m.name} not healthy after {timeout_s}s:\n{m.tail_log()}")
                time.sleep(0.05)

    def kill(self, i: int) -> None:
        self.members[i].kill()

    def stop(self) -> None:
        for m in self.members:
            try:
                m.stop()
            except Exception:
                m.kill()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------- container path


def _image_tar() -> bytes:
    """A root filesystem with etcd, its loader and libc (the binary links only those)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = [ETCD_BINARY, "/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"]
        for path in files:
            real = os.path.realpath(path)
            info = tar.gettarinfo(real, arcname=path.lstrip("/"))
            with open(real, "rb") as f:
                tar.addfile(info, f)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
    return buf.getvalue()


def build_image(tag: str = ETCD_IMAGE) -> str:
    """``docker import`` the etcd root filesystem as ``tag`` (idempotent)."""
    docker = shutil.which("docker")
    if docker is None:
        raise Unavailable("no docker client")
    have = subprocess.run([docker, "image", "inspect", tag], capture_output=True)
    if have.returncode == 0:
        return tag
    r = subprocess.run([docker, "import", "-", tag], input=_image_tar(), capture_output=True, timeout=120)
    if r.returncode != 0:
        raise Unavailable(f"docker import failed: {r.stderr.decode(errors='replace')[:500]}")
    return tag


class EtcdContainer:
    """One etcd member in a container (testcontainers, host networking, locally built image)."""

    def __init__(self, *, image: str | None = None) -> None:
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        self.image = image or build_image()
        self.client_port = free_port()
        self.peer_port = free_port()
        self.container = None

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{self.client_port}"]

    def start(self) -> "EtcdContainer":
        from testcontainers.core.container import DockerContainer

        args = _member_args("etcd-c", "/tmp/etcd-data", self.client_port, self.peer_port,
                            f"etcd-c=http://127.0.0.1:{self.peer_port}", f"hourglass-{self.peer_port}")
        self.container = (DockerContainer(self.image).with_command(["/usr/bin/etcd", *args])
                          .with_kwargs(network_mode="host"))
        self.container.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not healthy(self.endpoints[0]):
            if time.monotonic() > deadline:
                logs = b"".join(self.container.get_logs()) if self.container else b""
                raise Unavailable(f"etcd container not healthy after {timeout_s}s: {logs[-1000:]!r}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.container is not None:
            self.container.stop()
            self.container = None

    def __enter__(self) -> "EtcdContainer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
