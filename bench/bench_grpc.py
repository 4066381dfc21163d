"""What one gRPC call costs on this machine, before Hourglass does anything: the floor under
every hop of the hot path (producer -> delay node, delay node -> real-time node, consumer
pull). A grpc.aio echo server in its own process; a grpc.aio client in this one sends
``--calls`` requests of ``--bytes`` bytes, first as unary calls, then as messages on one
bidirectional stream (write, then read the echo). Reports CPU microseconds per call of the
client (``time.process_time``) and of the server process (``/proc/<pid>/stat``), wall
microseconds per call, and the load average.

``--pace-ms P`` sleeps P ms between calls, as a producer on a 10 ms tick does: on this VM a
call after an idle pause costs each side 3-4x the CPU of one back to back (caches cold after
the vCPU idled; ``--touch-mib`` measures that alone: the CPU time of reading N MiB after each
pause), docs/benchmarks.md "What a paced call costs".

    python bench/bench_grpc.py --calls 5000 --bytes 8192
    python bench/bench_grpc.py --calls 500 --bytes 60000 --pace-ms 10 --touch-mib 1
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import grpc

from common import REPO, cpu_s, emit, free_port, machine

SERVICE = "bench.Echo"
START_TIMEOUT_S = 30.0


def _handlers() -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for r in requests:
            yield r

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    })


async def _serve(port: int, interceptor: bool) -> None:
    from cluster.wire import UndecodableRequests

    server = grpc.aio.server(interceptors=[UndecodableRequests()] if interceptor else None)
    server.add_generic_rpc_handlers((_handlers(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _measure(address: str, calls: int, size: int, server_pid: int, interceptor: bool,
                   pace_s: float = 0.0) -> list[dict]:
    msg = b"x" * size
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        unary = ch.unary_unary(f"/{SERVICE}/Unary")
        for _ in range(100):  # warm up the channel
            await unary(msg, timeout=5)
        s0, c0, w0 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        for _ in range(calls):
            await unary(msg, timeout=5)
            if pace_s:
                await asyncio.sleep(pace_s)
        out.append(("unary", s0, c0, w0))
        call = ch.stream_stream(f"/{SERVICE}/Stream")()
        for _ in range(100):
            await call.write(msg)
            await call.read()
        s1, c1, w1 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        for _ in range(calls):
            await call.write(msg)
            await call.read()
            if pace_s:
                await asyncio.sleep(pace_s)
        s2, c2, w2 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        await call.done_writing()
    marks = [(s0, c0, w0), (s1, c1, w1), (s2, c2, w2)]
    for name, (a, b) in zip(("unary", "stream message"), zip(marks, marks[1:])):
        out_rec = {"bench": "grpc", "path": name, "calls": calls, "bytes": size, "interceptor": interceptor,
                   "pace_ms": pace_s * 1000,
                   "client_cpu_us_per_call": round((b[1] - a[1]) / calls * 1e6, 1),
                   "server_cpu_us_per_call": round((b[0] - a[0]) / calls * 1e6, 1),
                   "wall_us_per_call": round((b[2] - a[2]) / calls * 1e6, 1)}
        out.append(out_rec)
    return [r for r in out if isinstance(r, dict)]


def _touch(mib: int, pace_s: float, rounds: int) -> dict:
    """Thread CPU us of summing ``mib`` MiB (one byte per cache line) after each pause: what
    cold caches cost the same work."""
    import numpy as np

    buf = np.arange(mib << 20, dtype=np.uint8)
    lines = buf[::64]
    total = 0.0
    for _ in range(rounds):
        if pace_s:
            time.sleep(pace_s)
        a = time.thread_time()
        int(lines.sum())
        total += time.thread_time() - a
    return {"bench": "grpc", "path": "touch", "mib": mib, "pace_ms": pace_s * 1000, "rounds": rounds,
            "cpu_us_per_touch": round(total / rounds * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--bytes", type=int, default=8192, help="request (and echo) size")
    p.add_argument("--interceptor", action="store_true", help="the server has the nodes' request interceptor")
    p.add_argument("--pace-ms", type=float, default=0.0, help="sleep between calls (a producer's tick)")
    p.add_argument("--touch-mib", type=int, default=0, help="also: CPU of reading this many MiB after each pause")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        asyncio.run(_serve(a.serve, a.interceptor))
        return
    if a.touch_mib:
        emit({**_touch(a.touch_mib, a.pace_ms / 1000, min(a.calls, 1000)), "machine": machine()})
        if a.pace_ms:
            emit({**_touch(a.touch_mib, 0.0, min(a.calls, 1000)), "machine": machine()})
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), *(["--interceptor"] if a.interceptor else [])], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready" or time.monotonic() > deadline:
            raise SystemExit("bench_grpc: the echo server did not start")
        for rec in asyncio.run(_measure(f"127.0.0.1:{port}", a.calls, a.bytes, proc.pid, a.interceptor,
                                              a.pace_ms / 1000)):
            emit({**rec, "machine": machine()})
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
