"""The /metrics endpoint of nodes and meta servers (issue 27): its address is a setting (the
chart binds the pod IP), and it can ask for a bearer token and speak HTTPS. Real sockets and
real processes; 127.0.0.2 stands in for a pod IP (Linux answers all of 127.0.0.0/8)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from cluster import certs
from cluster.client import Producer, StaticResolver
from cluster.devcluster import LocalCluster
from cluster.errors import InvalidArgument
from cluster.metricsserver import MetricsEndpoint, MetricsServer
from cluster.ports import free_port

POD_IP = "127.0.0.2"
TIMEOUT_S = 5


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("hourglass_test_things", "a counter to find", registry=r).inc(3)
    return r


def _get(url: str, token: str | None = None, context=None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def _send_one(resolver) -> None:
    async with Producer(resolver) as p:
        await p.send_and_wait("metrics.timed", b"x", delay_ms=60_000, id="timed-1")


def _sample(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a scrape."""
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _refused(url: str, context=None) -> bool:
    try:
        urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context).read()
    except (urllib.error.URLError, ConnectionError, ssl.SSLError, OSError):
        return True
    return False


def test_the_endpoint_listens_on_the_address_set_and_nowhere_else():
    server = MetricsServer.start(_registry(), MetricsEndpoint(host=POD_IP, port=0))
    try:
        status, text = _get(f"http://{POD_IP}:{server.port}/metrics")
        assert status == 200 and "hourglass_test_things_total 3.0" in text
        assert _refused(f"http://127.0.0.1:{server.port}/metrics")  # not loopback's 127.0.0.1, not 0.0.0.0
    finally:
        server.stop()
    assert MetricsServer.start(_registry(), MetricsEndpoint(port=None)) is None  # no port: no endpoint


def test_a_token_is_asked_for_and_read_again_when_rotated(tmp_path):
    token_file = tmp_path / "metrics.token"
    token_file.write_text("first-token\n")
    server = MetricsServer.start(_registry(), MetricsEndpoint(host="127.0.0.1", port=0, token_file=token_file))
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        assert _get(url)[0] == 401
        assert _get(url, "wrong")[0] == 401
        status, text = _get(url, "first-token")
        assert status == 200 and "hourglass_test_things" in text
        token_file.write_text("second-token-longer\n")  # another size: the change is seen at once
        assert _get(url, "first-token")[0] == 401
        assert _get(url, "second-token-longer")[0] == 200
    finally:
        server.stop()


def test_https_only_when_a_certificate_is_given(tmp_path):
    certs.make_ca(tmp_path)
    crt, key = certs.issue(tmp_path, tmp_path, "metrics", kind="node", hosts=("127.0.0.1",), stem="m")
    server = MetricsServer.start(_registry(), MetricsEndpoint(host="127.0.0.1", port=0, tls_cert_file=crt,
                                                              tls_key_file=key))
    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        status, text = _get(f"https://127.0.0.1:{server.port}/metrics", context=ctx)
        assert status == 200 and "hourglass_test_things" in text
        assert _refused(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()


def test_bad_settings_are_one_clear_error(tmp_path):
    with pytest.raises(InvalidArgument, match="both a certificate and a key"):
        MetricsEndpoint(port=0, tls_cert_file=tmp_path / "x.crt")
    with pytest.raises(InvalidArgument, match="cannot read"):
        MetricsServer.start(_registry(), MetricsEndpoint(port=0, token_file=tmp_path / "missing"))


def test_node_and_meta_server_processes_bind_the_metrics_host(tmp_path):
    node_port, meta_port = free_port(), free_port()
    token = tmp_path / "scrape.token"
    token.write_text("scrape-me\n")
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=1, meta=True)
    c.delay[0].env.update({"HOURGLASS_METRICS_HOST": POD_IP, "HOURGLASS_METRICS_PORT": str(node_port)})
    c.meta[0].env.update({"HOURGLASS_META_METRICS_HOST": POD_IP, "HOURGLASS_META_METRICS_PORT": str(meta_port),
                          "HOURGLASS_META_METRICS_TOKEN_FILE": str(token)})
    with c:
        c.wait_registered()
        status, text = _get(f"http://{POD_IP}:{node_port}/metrics")
        assert status == 200 and "hourglass_ingested_messages_total" in text
        asyncio.run(_send_one(StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])))
        text = _get(f"http://{POD_IP}:{node_port}/metrics")[1]
        for name in ("hourglass_send_seconds", "hourglass_wal_fsync_seconds", "hourglass_wal_fsync_handback_seconds"):
            assert _sample(text, name + "_count") >= 1, name  # the send was timed, and its fsync round
        assert _refused(f"http://127.0.0.1:{node_port}/metrics")
        assert _get(f"http://{POD_IP}:{meta_port}/metrics")[0] == 401
        status, text = _get(f"http://{POD_IP}:{meta_port}/metrics", "scrape-me")
        assert status == 200 and "hourglass_meta_etcd_healthy 1.0" in text, text[-500:]
