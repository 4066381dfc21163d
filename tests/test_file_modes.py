"""Issue 27, secrets and data on disk (docs/security.md "Secrets and data on disk"): keys,
tokens and the auth file are owner-only from their first instant and never land in a file
another user planted; every file a node or the local cluster writes is 0600 and every folder
0700."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from cluster import certs, files
from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from cluster.security import Grant
from node.delay.store import DelayStore, StoreSettings
from node.realtime.store import RealtimeSettings, RealtimeStore
from node.store import checkpoint
from node.store.records import Limits, Message

T0 = 1_800_000_000_000
OTHER_UID = 65534  # "nobody": as root, a planted file really belongs to another user
HOURGLASS = shutil.which("hourglass", path=str(Path(sys.executable).parent)) or shutil.which("hourglass")
PUBLIC_SUFFIXES = (".crt",)  # certificates are public: 0644 on purpose


@contextmanager
def umask(mask: int):
    """Run with ``mask`` (0: a file gets exactly the mode it was created with)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def plant(p: Path, data: bytes = b"planted by someone else\n") -> os.stat_result:
    """A world-writable file at ``p``, another user's when we are root."""
    p.write_bytes(data)
    os.chmod(p, 0o666)
    if os.getuid() == 0:
        os.chown(p, OTHER_UID, OTHER_UID)
    return p.stat()


def wrong_modes(root: Path) -> list[str]:
    """Every file under ``root`` that is not 0600 (certificates: 0644) or folder not 0700."""
    wrong = []
    for d, dirs, names in os.walk(root):
        for n in dirs:
            p = Path(d) / n
            try:
                if mode(p) != 0o700:
                    wrong.append(f"{p.relative_to(root)}/ {oct(mode(p))}")
            except FileNotFoundError:
                pass  # removed while we walked (a finished swap)
        for n in names:
            p = Path(d) / n
            try:
                want = 0o644 if n.endswith(PUBLIC_SUFFIXES) else 0o600
                if not p.is_symlink() and mode(p) != want:
                    wrong.append(f"{p.relative_to(root)} {oct(mode(p))}")
            except FileNotFoundError:
                pass
    return wrong


# ---------------------------------------------------------------------- the writer itself


def test_a_planted_tmp_file_never_becomes_the_key(tmp_path, monkeypatch):
    """The attack of issue 27: another user pre-creates the temporary file (the old fixed
    ``ca.key.tmp``, and the first random name the writer will try) world-writable. The key
    is written to a fresh file of ours anyway; the planted files are left as they were."""
    old_style = plant(tmp_path / "ca.key.tmp")
    names = iter(["0000000000000000"])
    real = files.secrets.token_hex
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names, None) or real(n))
    guessed = plant(tmp_path / ".ca.key.0000000000000000.tmp")
    crt, key = certs.make_ca(tmp_path)
    st = key.stat()
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, os.getuid(), os.getgid())
    assert st.st_ino not in (old_style.st_ino, guessed.st_ino)
    for p, before in ((tmp_path / "ca.key.tmp", old_style), (tmp_path / ".ca.key.0000000000000000.tmp", guessed)):
        assert p.read_bytes() == b"planted by someone else\n" and p.stat().st_ino == before.st_ino
        assert mode(p) == 0o666  # untouched: never opened for writing
    assert mode(crt) == 0o644


def test_a_planted_symlink_is_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me\n")
    names = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".admin.token.aaaa.tmp").symlink_to(victim)
    files.write_secret(tmp_path / "admin.token", b"hgt_secret\n")
    assert victim.read_bytes() == b"keep me\n"
    assert (tmp_path / "admin.token").read_bytes() == b"hgt_secret\n" and mode(tmp_path / "admin.token") == 0o600
    assert not (tmp_path / ".admin.token.bbbb.tmp").exists()


def test_every_name_taken_is_an_error_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "same")
    plant(tmp_path / ".k.same.tmp")
    with pytest.raises(FileExistsError):
        files.write_secret(tmp_path / "k", b"secret")
    assert not (tmp_path / "k").exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    files.write_secret(tmp_path / "k", b"old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError):
        files.write_secret(tmp_path / "k", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"] and (tmp_path / "k").read_bytes() == b"old"


def test_every_secret_the_tools_write_is_owner_only_whatever_the_umask(tmp_path):
    """umask 0: the modes come from creation, not from the caller's umask."""
    with umask(0):
        sec = certs.dev_security(tmp_path)  # what dev up --secure and LocalCluster(secure=True) make
        certs.issue(sec.dir, sec.dir, "orders", kind="client", hosts=(), stem="client-orders")
        certs.add_token(sec.auth_file, "reader", [Grant(action="consume")], tmp_path / "new" / "reader.token")
        certs.grant_certificate(sec.auth_file, "by-cert", "client:orders", [Grant(action="produce")])
    for p in (sec.node_key, sec.client_key, sec.dir / "ca.key", sec.dir / "client-orders.key", sec.auth_file,
              sec.admin_token_file, tmp_path / "new" / "reader.token"):
        assert mode(p) == 0o600, p
    assert mode(sec.dir) == 0o700 and mode(tmp_path / "new") == 0o700
    assert mode(sec.ca) == mode(sec.node_cert) == 0o644
    assert wrong_modes(tmp_path) == []
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_checkpoints_are_owner_only_and_replace_a_planted_tmp(tmp_path):
    plant(tmp_path / "checkpoint.tmp")  # the old fixed name
    with umask(0):
        checkpoint.write_atomic(tmp_path / "checkpoint", {"epoch": 3})
    assert checkpoint.read(tmp_path / "checkpoint") == {"epoch": 3} and mode(tmp_path / "checkpoint") == 0o600
    assert (tmp_path / "checkpoint").stat().st_uid == os.getuid()


def test_the_stores_make_owner_only_files_whatever_the_umask(tmp_path):
    """A delay store (message log, schedule, id index, dispatch log, checkpoints) and a
    real-time store (log, index, offsets) opened, written, restarted under umask 0: every
    file 0600 and folder 0700, so the modes do not rest on the process umask alone."""
    delay_settings = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14,
                                   schedule_segment_bytes=1 << 16, id_slots=256, id_entries_max=4096,
                                   limits=Limits(payload_bytes_max=1024))
    with umask(0):
        d = DelayStore.open(tmp_path / "delay", delay_settings, now_ms=T0)
        msgs = [Message(seq=0, store_ms=0, deliver_at_ms=T0 + 10 * i, msg_id=f"m{i}", subject="orders", payload=b"x")
                for i in range(20)]
        d.accept(msgs, now_ms=T0)
        d.flush_messages()
        d.iterate(limit=None)
        for due in d.poll_due(now_ms=T0 + 100):
            d.ack_dispatched(due.unit, np.arange(due.batch.n), now_ms=T0 + 100)
        d.cancel("m19", now_ms=T0 + 100)
        d.close()
        DelayStore.open(tmp_path / "delay", delay_settings, now_ms=T0 + 200).close()

        r = RealtimeStore.open(tmp_path / "realtime", RealtimeSettings(segment_bytes=1 << 14), now_ms=T0)
        b = Batch.build(["orders"] * 3, [b"a", b"b", b"c"], ["r1", "r2", "r3"], np.full(3, T0, np.int64))
        r.append(b, now_ms=T0)
        r.flush()
        got, handles = r.pull(["orders"], "billing", "c", max_messages=10, now_ms=T0 + 1)
        assert got.n == 3
        r.ack("orders", "billing", [(0, 3)], now_ms=T0 + 2)
        r.close()
        RealtimeStore.open(tmp_path / "realtime", RealtimeSettings(segment_bytes=1 << 14), now_ms=T0 + 3).close()
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) > 10  # it did write
    assert wrong_modes(tmp_path / "delay") == [] and wrong_modes(tmp_path / "realtime") == []


# ---------------------------------------------------------------------- processes


@pytest.mark.integration  # tier: a CLI subprocess
def test_certs_that_cannot_write_say_so_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")}
    p = subprocess.run([HOURGLASS, "certs", "ca", "--dir", str(tmp_path / "a-file" / "secrets")], capture_output=True,
                       text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert 1 <= len(p.stderr.strip().splitlines()) <= 2 and "cannot write in" in p.stderr, p.stderr


@pytest.mark.integration  # tier: real processes, etcd and gRPC
def test_a_local_cluster_leaves_only_owner_only_files(tmp_path):
    """etcd, a meta server, a replicated delay group and a real-time node, secure, started from
    this test process (umask 022 as usual): after messages went through and every process
    stopped, every file under the cluster's folder is 0600 (certificates 0644) and every folder
    0700: logs, ready files, cluster.json, keys and tokens, message logs, schedule, id index,
    dispatch log, checkpoints, replication files, the real-time store, etcd's data."""
    from cluster.discovery import MetaResolver
    from tests.helpers.flow import round_trip

    root = tmp_path / "cluster"
    with umask(0o022):
        c = LocalCluster(root, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, lease_ttl_ms=2000, secure=True)
        with c:
            c.wait_registered()

            async def flow() -> set[str]:
                r = MetaResolver(c.meta_addresses, security=c.client_security())
                try:
                    return await round_trip(r, "orders.modes", "modes-1", delay_ms=200)
                finally:
                    await r.close()
            assert asyncio.run(flow()) == {"modes-1"}
            assert mode(root / "cluster.json") == 0o600  # removed at stop
        # stopped: nothing is being replaced while we look
    for name in ("delay-1", "delay-2", "realtime-1"):
        assert any((root / name).rglob("*")), f"{name} wrote nothing"
    assert any((root / "etcd").rglob("*")) and any(root.glob("*.log")) and any((root / "security").glob("*.key"))
    assert wrong_modes(root) == []
    assert mode(root) == 0o700

