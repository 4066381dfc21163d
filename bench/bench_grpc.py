"""What one gRPC call costs on this machine, before Hourglass does anything: the floor under
every hop of the hot path (producer -> delay node, delay node -> real-time node, consumer
pull). A grpc.aio echo server in its own process; a grpc.aio client in this one sends
``--calls`` requests of ``--bytes`` bytes, first as unary calls, then as messages on one
bidirectional stream (write, then read the echo). Reports CPU microseconds per call of the
client (``time.process_time``) and of the server process (``/proc/<pid>/stat``), wall
microseconds per call, and the load average.

    python bench/bench_grpc.py --calls 5000 --bytes 8192
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


async def _measure(address: str, calls: int, size: int, server_pid: int, interceptor: bool) -> list[dict]:
    msg = b"x" * size
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        unary = ch.unary_unary(f"/{SERVICE}/Unary")
        for _ in range(100):  # warm up the channel
            await unary(msg, timeout=5)
        s0, c0, w0 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        for _ in range(calls):
            await unary(msg, timeout=5)
        out.append(("unary", s0, c0, w0))
        call = ch.stream_stream(f"/{SERVICE}/Stream")()
        for _ in range(100):
            await call.write(msg)
            await call.read()
        s1, c1, w1 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        for _ in range(calls):
            await call.write(msg)
            await call.read()
        s2, c2, w2 = cpu_s(server_pid), time.process_time(), time.perf_counter()
        await call.done_writing()
    marks = [(s0, c0, w0), (s1, c1, w1), (s2, c2, w2)]
    for name, (a, b) in zip(("unary", "stream message"), zip(marks, marks[1:])):
        out_rec = {"bench": "grpc", "path": name, "calls": calls, "bytes": size, "interceptor": interceptor,
                   "client_cpu_us_per_call": round((b[1] - a[1]) / calls * 1e6, 1),
                   "server_cpu_us_per_call": round((b[0] - a[0]) / calls * 1e6, 1),
                   "wall_us_per_call": round((b[2] - a[2]) / calls * 1e6, 1)}
        out.append(out_rec)
    return [r for r in out if isinstance(r, dict)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--bytes", type=int, default=8192, help="request (and echo) size")
    p.add_argument("--interceptor", action="store_true", help="the server has the nodes' request interceptor")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        asyncio.run(_serve(a.serve, a.interceptor))
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), *(["--interceptor"] if a.interceptor else [])], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready" or time.monotonic() > deadline:
            raise SystemExit("bench_grpc: the echo server did not start")
        for rec in asyncio.run(_measure(f"127.0.0.1:{port}", a.calls, a.bytes, proc.pid, a.interceptor)):
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
