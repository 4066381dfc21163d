"""The Redis sorted-set delay queue that bench_e2e.py runs Hourglass against.

What a user would build instead of Hourglass:

* producer: pipelined batches, per batch one ``ZADD dq {id: due_ms}`` and one
  ``HSET dq:body {id: subject|payload}``; a message counts once its batch's reply
  arrives (with ``appendfsync always`` Redis fsyncs the AOF before it replies);
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


async def produce(url: str, messages, *, batch: int = 500, inflight: int = 8) -> list[tuple[str, int]]:
    """Send ``messages`` (iterable of (id, subject, payload, due_ms_fn)) in pipelined batches;
    returns [(id, due_ms)] of acknowledged ones. ``due_ms_fn()`` is called at send time."""
    import asyncio

    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url)
    acked: list[tuple[str, int]] = []
    sem = asyncio.Semaphore(inflight)
    tasks: set[asyncio.Task] = set()

    async def send(items: list[tuple[str, str, bytes, int]]) -> None:
        try:
            async with r.pipeline(transaction=False) as p:
                p.zadd("dq", {i: due for i, _, _, due in items})
                p.hset("dq:body", mapping={i: s.encode() + b"|" + pl for i, s, pl, _ in items})
                await p.execute()
            acked.extend((i, due) for i, _, _, due in items)
        finally:
            sem.release()

    buf: list[tuple[str, str, bytes, int]] = []
    for mid, subject, payload, due_fn in messages:
        buf.append((mid, subject, payload, due_fn()))
        if len(buf) >= batch:
            await sem.acquire()
            t = asyncio.get_running_loop().create_task(send(buf))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            buf = []
            await asyncio.sleep(0)
    if buf:
        await sem.acquire()
        await send(buf)
    while tasks:
        await asyncio.gather(*list(tasks))
    await r.aclose()
    return acked


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
