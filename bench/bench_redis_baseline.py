"""The Redis sorted-set delay queue that bench_e2e.py runs Hourglass against.

What a user would build instead of Hourglass:

* producer (``RedisSender``): pipelined batches, per batch one ``ZADD dq {id: due_ms}``
  and one ``HSET dq:body {id: subject|payload}``; a message counts once its batch's
  reply arrives (with ``appendfsync always`` Redis fsyncs the AOF before it replies);
* poller (its own process, the "delay worker"): every ``poll_ms`` one Lua script
  takes up to ``batch`` members with score <= now (``ZRANGEBYSCORE`` + ``ZREM``),
  moves each body to the ready list of its subject (``LPUSH ready:{subject}``),
  repeats at once while it keeps finding a full batch;
* consumer (bench_e2e.py's consumer process): ``BLMPOP`` over the 16 ready lists.

The server is started here on a free 127.0.0.1 port with AOF on and stopped by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

REDIS_SERVER = "/usr/bin/redis-server"
START_TIMEOUT_S = 20.0
POLL_RUNTIME_MAX_S = 3600.0

# KEYS[1] = zset, KEYS[2] = bodies hash; ARGV[1] = now_ms, ARGV[2] = batch max
MOVE_DUE_LUA = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return 0 end
redis.call('ZREM', KEYS[1], unpack(ids))
local bodies = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('HDEL', KEYS[2], unpack(ids))
for i, id in ipairs(ids) do
  local b = bodies[i]
  if b then
    local sep = string.find(b, '|', 1, true)
    redis.call('LPUSH', 'ready:' .. string.sub(b, 1, sep - 1), id .. '|' .. string.sub(b, sep + 1))
  end
end
return #ids
"""


class RedisServer:
    def __init__(self, data_dir: Path, *, appendfsync: str = "always") -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        cmd = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
               "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
               "--protected-mode", "yes", "--logfile", str(self.data_dir / "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited {self.proc.returncode}")
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisSender:
    """The producer side: ``submit`` one chunk of messages as one pipelined batch (``ZADD``
    + ``HSET``); a message counts once its batch's reply arrives. At most ``inflight_max``
    batches are on the wire; ``submit(wait=False)`` (open loop) queues a batch behind
    them instead of waiting for a slot."""

    def __init__(self, url: str, *, inflight_max: int = 8, keep: bool = True) -> None:
        import asyncio

        import redis.asyncio as aredis

        self.r = aredis.Redis.from_url(url, max_connections=inflight_max + 2)
        self.sem = asyncio.Semaphore(inflight_max)
        self.tasks: set = set()
        self.keep = keep
        self.acked: list[tuple[list[str], object]] = []  # (ids, due_ms array) per acknowledged batch (with keep)
        self.count = 0
        self.errors = 0
        self.last_ack = time.perf_counter()

    async def _send(self, ids: list[str], subjects: list[str], payloads: list[bytes], due, held: bool) -> None:
        if not held:
            await self.sem.acquire()
        try:
            dues = due.tolist()
            async with self.r.pipeline(transaction=False) as p:
                p.zadd("dq", dict(zip(ids, dues)))
                p.hset("dq:body", mapping={i: s.encode() + b"|" + pl for i, s, pl in zip(ids, subjects, payloads)})
                await p.execute()
            self.count += len(ids)
            if self.keep:
                self.acked.append((ids, due))
            self.last_ack = time.perf_counter()
        except Exception:
            self.errors += len(ids)
        finally:
            self.sem.release()

    async def submit(self, ids: list[str], subjects: list[str], payloads: list[bytes], due, *,
                     wait: bool = True) -> None:
        import asyncio

        if wait:
            await self.sem.acquire()
        t = asyncio.get_running_loop().create_task(self._send(ids, subjects, payloads, due, wait))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def finish(self) -> None:
        import asyncio

        while self.tasks:
            await asyncio.gather(*list(self.tasks))
        await self.r.aclose()


def poller(url: str, poll_ms: int, batch: int, stop_file: str) -> None:
    """The delay worker: moves due members to ready lists until ``stop_file`` exists."""
    import redis

    r = redis.Redis.from_url(url)
    move = r.register_script(MOVE_DUE_LUA)
    deadline = time.monotonic() + POLL_RUNTIME_MAX_S
    checks = 0
    while time.monotonic() < deadline:
        n = move(keys=["dq", "dq:body"], args=[time.time_ns() // 1_000_000, batch])
        if n >= batch:
            continue
        checks += 1
        if checks % 50 == 0 and os.path.exists(stop_file):
            return
        time.sleep(poll_ms / 1000)


if __name__ == "__main__":
    # python bench/bench_redis_baseline.py poller URL POLL_MS BATCH STOP_FILE
    if len(sys.argv) == 6 and sys.argv[1] == "poller":
        poller(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        print(__doc__)
