"""What every node process runs beside its own loops: the scrub, its registration at the
meta servers, the stall watch, the malloc trim, the metrics endpoint. One place, so a delay
node, a real-time node and a replicated one start them alike."""

from __future__ import annotations

import asyncio
import logging

from cluster.metricsserver import MetricsEndpoint
from node.aio import StallWatch, trim_memory_loop, tune_gc
from node.registration import Registrar


def side_tasks(tg: asyncio.TaskGroup, node, log: logging.Logger, *, register: bool = True,
               gc_tuned: bool = True) -> list[asyncio.Task]:
    """Start them in ``tg`` for ``node`` (its ``settings``, ``scrubber``, ``metrics``,
    ``address``, ``registration_info``); ``register``: also its registration (a replicated
    node makes its own, with a heartbeat hook; either way the node's ``registrar`` reports its
    renewal timing to the node's metrics)."""
    settings = node.settings
    tasks = []
    if settings.scrub.rate_mib_s > 0:
        tasks.append(tg.create_task(node.scrubber.run(), name="scrub"))
    if register and settings.meta.servers:
        node.registrar = Registrar(settings, node.address, describe=node.registration_info, health=node.health)
        tasks.append(tg.create_task(node.registrar.run(), name="registration"))
    if getattr(node, "registrar", None) is not None:
        # its own or the replicated node's: renewal timing goes to this node's metrics
        node.registrar.metrics = node.metrics
        fences = getattr(node, "fences", None)  # a real-time node's (node/realtime/fence.py)
        if fences is not None:
            node.registrar.on_fences = fences.load
            node.registrar.on_merged = fences.merged

            def master() -> bool:
                return getattr(node, "mode", "master") == "master"
            node.registrar.drained = lambda: fences.drained(node.store) if master() else []
            node.registrar.consumers = lambda: fences.report(node.store) if master() else (0, [])
    if settings.loop.stall_report_ms:
        watch = StallWatch(settings.loop.stall_report_ms, log, histogram=node.metrics.loop_stall)
        tasks.append(tg.create_task(watch.run(), name="stall-watch"))
    sv = settings.server
    node.metrics.start(MetricsEndpoint(sv.metrics_host, sv.metrics_port, sv.metrics_tls_cert_file,
                                       sv.metrics_tls_key_file, sv.metrics_token_file))
    tasks.append(tg.create_task(trim_memory_loop(), name="malloc-trim"))
    if gc_tuned:
        tune_gc(log)
    return tasks
