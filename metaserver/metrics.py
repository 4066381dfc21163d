"""Prometheus metrics of one meta server process, on its own registry: calls refused by
authentication or permissions, and whether etcd answers (docs/operations.md "Metrics endpoint")."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from cluster.metricsserver import ServesMetrics
from cluster.security import REFUSALS
from cluster.wire import REQUESTS


class MetaMetrics(ServesMetrics):
    def __init__(self, healthy: Callable[[], bool]) -> None:
        self.registry = r = CollectorRegistry()
        r.register(REFUSALS)  # calls refused by authentication or permissions (cluster/security.py)
        r.register(REQUESTS)  # requests served by method (cluster/wire.py)
        self.etcd_healthy = Gauge("hourglass_meta_etcd_healthy", "1 while this meta server's etcd health check "
                                  "passes (the readiness probe follows it)", registry=r)
        self.etcd_healthy.set_function(lambda: 1.0 if healthy() else 0.0)
