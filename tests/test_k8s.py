"""The Helm chart against a real Kubernetes control plane built here (issue 17, levels 1 to 3).

``scripts/k8s-local.sh up`` starts etcd, kube-apiserver, kube-controller-manager and
kube-scheduler (Kubernetes v1.37.2, built once from the Go module proxy and cached under
``~/.cache/hourglass/k8s-v1.37.2``) on 127.0.0.1 for the whole session; the fixture stops them by
PID at the end. Levels 1 and 2 run without a kubelet: pods are created by the real controllers
and admitted by the real admission chain (PodSecurity ``restricted``, ServiceAccount), then stay
Pending. Level 3 (last in the module) adds a node (``k8s-local.sh node-up``: containerd, runc,
CoreDNS, a kubelet): a pause pod, then the chart's own pods from the image built here, with a
probe pod measuring the failover after the delay master pod is deleted and after ``kill -9``.

What a real server checks that ``kubernetes-validate`` (tests/test_helm.py) cannot: admission,
cross-field validation, CRDs, owner references and garbage collection, the chart's
``kubeVersion`` against a server's version, helm's own release bookkeeping.

Skips: ``HOURGLASS_K8S=0`` skips the tier; ``HOURGLASS_K8S_BUILD=0`` skips it unless the
binaries are already cached; a build that fails (no Go, the proxy refuses) skips with the
refused command. A cluster that was built but does not come up fails.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "hourglass"
SCRIPT = ROOT / "scripts" / "k8s-local.sh"
K8S_VERSION = "v1.37.2"
RELEASE = "hg"
VALUES = {  # values file -> the pods its workloads ask for
    "default": (None, 2 + 2 + 2 + 3 + 1),  # meta servers, d1, r1, etcd, the console
    "large": (CHART / "ci" / "large-values.yaml", 3 + (3 + 2 + 4) + (3 + 2) + 5 + 1),
    "external-etcd": (CHART / "ci" / "external-etcd-values.yaml", 1 + 1 + 1 + 1),
    "local-node": (CHART / "ci" / "local-node-values.yaml", 1 + 2 + 1 + 1),
}
assert {p.name for p in (CHART / "ci").glob("*.yaml")} == {v.name for v, _ in VALUES.values() if v}, \
    "a values file in helm/hourglass/ci/ has no row in VALUES"
BUILD_TIMEOUT_S = int(os.environ.get("K8S_BUILD_TIMEOUT_S", "2700"))
WAIT_S = 90  # every wait on the cluster below is bounded by this
CONTROLLERS_WAIT_S = 60  # the controller-manager makes the root CA config map after its start

# the test tier (tests/conftest.py) is `integration`, once pyproject.toml registers it
# (--strict-markers refuses an unregistered one)
_MARKERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
_TIER = [pytest.mark.integration] if any(m.startswith("integration:") for m in _MARKERS) else []
# a first run may build Kubernetes inside the session fixture (~25 min on 2 cores): the fixture's
# own subprocess timeouts bound it, the per-test timeout must not cut it short
pytestmark = [pytest.mark.k8s, *_TIER, pytest.mark.timeout(BUILD_TIMEOUT_S + 600)]


def _cached() -> bool:
    return subprocess.run(["bash", str(SCRIPT), "cached"], capture_output=True, timeout=60).returncode == 0


class Cluster:
    def __init__(self, env: dict[str, str], dir: Path):
        self.env = env
        self.dir = dir
        self.kubeconfig = env["KUBECONFIG"]
        self.kubectl_bin = env["KUBECTL"]
        self.helm_bin = env["HELM"]

    def run(self, *args: str, input: str | None = None, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=timeout,
                              env={**os.environ, "KUBECONFIG": self.kubeconfig})

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = self.run(self.kubectl_bin, *args, input=input)
        if check:
            assert r.returncode == 0, f"kubectl {' '.join(args)}:\n{r.stderr}"
        return r

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = self.run(self.helm_bin, *args, timeout=180)
        if check:
            assert r.returncode == 0, f"helm {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
        return r

    def get(self, kind: str, namespace: str, *args: str) -> list[dict]:
        return json.loads(self.kubectl("get", kind, "-n", namespace, "-o", "json", *args).stdout)["items"]

    def namespace(self, name: str) -> str:
        """A fresh namespace that enforces the `restricted` Pod Security Standard."""
        self.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true", f"--timeout={WAIT_S}s")
        self.kubectl("create", "namespace", name)
        self.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted",
                     "pod-security.kubernetes.io/enforce-version=latest")
        # the service-account controller's `default` account: pods are admitted only once it exists
        wait_until(lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
                   f"service account {name}/default")
        return name


def wait_until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("HOURGLASS_K8S") == "0":
        pytest.skip("HOURGLASS_K8S=0: the k8s tier is switched off")
    if os.environ.get("HOURGLASS_K8S_BUILD") == "0" and not _cached():
        pytest.skip(f"HOURGLASS_K8S_BUILD=0 and Kubernetes {K8S_VERSION} is not cached: "
                    "`bash scripts/k8s-local.sh build` would build it")
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SCRIPT), "build"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S + 60,
                       env={**os.environ, "K8S_BUILD_TIMEOUT_S": str(BUILD_TIMEOUT_S)})
    if r.returncode != 0:
        pytest.skip(f"`bash scripts/k8s-local.sh build` refused: {r.stderr.strip()[-800:]}")
    print(f"k8s: binaries ready in {time.monotonic() - t0:.0f} s")
    d = tmp_path_factory.mktemp("k8s")
    down = ["bash", str(SCRIPT), "down", str(d)]
    atexit.register(subprocess.run, down, capture_output=True, timeout=60)  # even if teardown never runs
    try:
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(SCRIPT), "up", str(d)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "K8S_READY_TIMEOUT_S": "120"})
        assert r.returncode == 0, f"`bash scripts/k8s-local.sh up {d}` failed:\n{r.stderr[-3000:]}"
        print(f"k8s: control plane up in {time.monotonic() - t0:.1f} s")
        env = dict(line.split("=", 1) for line in (d / "env").read_text().splitlines() if "=" in line)
        yield Cluster(env, d)
    finally:
        subprocess.run(down, capture_output=True, timeout=60)
        left = subprocess.run(["bash", str(SCRIPT), "status", str(d)], capture_output=True, text=True, timeout=30)
        assert left.stdout.strip() == "", f"processes outlived `k8s-local.sh down`: {left.stdout}"


@pytest.fixture(scope="session")
def servicemonitor_crd(cluster) -> Path:
    r = subprocess.run(["bash", str(SCRIPT), "crd", "servicemonitors"], capture_output=True, text=True, timeout=660)
    if r.returncode != 0:
        pytest.skip(f"`bash scripts/k8s-local.sh crd servicemonitors` refused: {r.stderr.strip()[-500:]}")
    return Path(r.stdout.strip())


def install_crd(cluster: Cluster, crd: Path) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    # right after the apply the CRD may have no status yet, and `kubectl wait` then fails at
    # once ("status.conditions accessor error: <nil>") instead of waiting: ask again (bounded)
    deadline = time.monotonic() + WAIT_S
    while True:
        r = cluster.kubectl("wait", "--for=condition=Established", f"--timeout={WAIT_S}s",
                            "crd/servicemonitors.monitoring.coreos.com", check=False)
        if r.returncode == 0 or "accessor error" not in r.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0, f"the ServiceMonitor CRD is not established: {r.stderr}"


def values_args(name: str) -> list[str]:
    path, _ = VALUES[name]
    return ["-f", str(path)] if path else []


def ns_of(name: str) -> str:
    return "hg-" + name


# ------------------------------------------------------------------ level 1: the server itself


def test_server_is_the_pinned_version(cluster):
    v = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert v["serverVersion"]["gitVersion"] == K8S_VERSION  # the chart's kubeVersion is checked against it
    assert v["clientVersion"]["gitVersion"] == K8S_VERSION
    # the controllers run: they make the `default` service account and the root CA config map
    # (within seconds of the start; longer on a machine still busy, e.g. right after the build)
    deadline = time.monotonic() + CONTROLLERS_WAIT_S
    while True:
        r = cluster.kubectl("get", "configmap", "kube-root-ca.crt", "-n", "default", check=False)
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0, f"no kube-root-ca.crt after {CONTROLLERS_WAIT_S} s: {r.stderr}"


# ------------------------------------------------------------------ level 2: the chart meets the server


@pytest.mark.parametrize("name", sorted(VALUES))
def test_server_side_dry_run(cluster, servicemonitor_crd, name):
    """helm's --dry-run=server and `kubectl apply --dry-run=server --validate=strict` of every
    rendered manifest: the server's own validation, defaulting and admission, nothing stored."""
    install_crd(cluster, servicemonitor_crd)
    ns = cluster.namespace(ns_of(name) + "-dry")
    r = cluster.helm("install", RELEASE, str(CHART), "-n", ns, *values_args(name), "--dry-run=server")
    assert "STATUS: pending-install" in r.stdout
    rendered = cluster.helm("template", RELEASE, str(CHART), "-n", ns, *values_args(name)).stdout
    r = cluster.kubectl("apply", "-n", ns, "--dry-run=server", "--validate=strict", "-f", "-", input=rendered)
    objs = [d for d in yaml.safe_load_all(rendered) if d]
    assert len([line for line in r.stdout.splitlines() if "(server dry run)" in line]) == len(objs), r.stdout
    # workloads are checked against the namespace's `restricted` level at creation: a warning here
    # would be a pod refused later
    assert "PodSecurity" not in r.stderr, r.stderr
    assert cluster.get("statefulsets", ns) == []  # a dry run stores nothing


@pytest.mark.parametrize("name", sorted(VALUES))
def test_install_upgrade_uninstall(cluster, servicemonitor_crd, name, record_property):
    """helm install: the controller-manager creates every pod the workloads ask for and each one
    passes admission (PodSecurity restricted; no service account token: automountServiceAccountToken
    false); upgrade adds a group; uninstall removes everything but the retained volume claims."""
    install_crd(cluster, servicemonitor_crd)
    ns = cluster.namespace(ns_of(name))
    path, pods_want = VALUES[name]
    t0 = time.monotonic()
    cluster.helm("install", RELEASE, str(CHART), "-n", ns, *values_args(name))

    def pods():
        return [p for p in cluster.get("pods", ns) if "deletionTimestamp" not in p["metadata"]]
    created = wait_until(lambda: (ps := pods()) and len(ps) >= pods_want and ps, f"{pods_want} pods in {ns}")
    record_property("install_to_pods_created_s", round(time.monotonic() - t0, 2))
    print(f"k8s: {name}: helm install to {pods_want} pods created in {time.monotonic() - t0:.2f} s")
    assert len(created) == pods_want
    events = cluster.get("events", ns)
    refused = [e["message"] for e in events if e.get("reason") in ("FailedCreate", "FailedCreatePodSandBox")]
    assert refused == [], refused
    for p in created:
        spec = p["spec"]
        assert spec["serviceAccountName"] == "default"
        # automountServiceAccountToken: false - ServiceAccount admission mounted no token
        # (no projected volume kube-api-access-*): nothing of Hourglass talks to the Kubernetes API
        assert not any(v["name"].startswith("kube-api-access-") for v in spec.get("volumes", [])), \
            p["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    workloads = cluster.get("statefulsets", ns) + cluster.get("deployments", ns)
    assert sum(w["spec"]["replicas"] for w in workloads) == pods_want
    # each StatefulSet member asked for its volume claim (Pending here: no provisioner, no kubelet)
    claims = {c["metadata"]["name"] for c in cluster.get("pvc", ns)}
    members = {p["metadata"]["name"] for p in created
               if "metaserver" not in p["metadata"]["name"] and "console" not in p["metadata"]["name"]}
    assert claims == {f"data-{m}" for m in members}
    if path and "serviceMonitor" in path.read_text():
        (sm,) = cluster.get("servicemonitors.monitoring.coreos.com", ns)
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"

    # upgrade: one more delay group; the existing ones are untouched
    groups = yaml.safe_load(path.read_text())["delayGroups"] if path else [{"name": "d1", "replicas": 2}]
    new = groups + [{"name": "dx", "replicas": 2}]
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", ns, *values_args(name), "--set-json",
                 f"delayGroups={json.dumps(new)}")
    wait_until(lambda: len(pods()) == pods_want + 2, f"{pods_want + 2} pods after the upgrade")
    assert {f"{RELEASE}-hourglass-delay-dx-0", f"{RELEASE}-hourglass-delay-dx-1"} <= {
        p["metadata"]["name"] for p in pods()}
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in created}
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods()}
    assert {n: after.get(n) for n in before} == before  # nothing restarted
    history = json.loads(cluster.helm("history", RELEASE, "-n", ns, "-o", "json").stdout)
    assert [h["status"] for h in history] == ["superseded", "deployed"]

    # uninstall: the garbage collector removes the pods; claims follow the retention policy
    claims = {c["metadata"]["name"] for c in cluster.get("pvc", ns)}
    cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", f"--timeout={WAIT_S}s")
    wait_until(lambda: pods() == [], f"no pods in {ns} after uninstall")
    for kind in ("statefulsets", "deployments", "services", "poddisruptionbudgets"):
        assert cluster.get(kind, ns) == [], kind
    retain = yaml.safe_load((path or CHART / "values.yaml").read_text()).get("nodes", {}).get(
        "pvcRetention", {}).get("whenDeleted", "Retain")
    etcd_claims = {c for c in claims if "-etcd-" in c}  # the etcd StatefulSet keeps its claims
    kept = claims if retain == "Retain" else etcd_claims  # Retain: the messages survive an uninstall
    wait_until(lambda: {c["metadata"]["name"] for c in cluster.get("pvc", ns)} == kept,
               f"claims left after uninstall with whenDeleted={retain}: {sorted(kept)}")


def test_servicemonitor_needs_its_crd_first(cluster, servicemonitor_crd):
    """What offline validation missed: with metrics.serviceMonitor.enabled the server refuses
    the release until the Prometheus Operator's CRD is installed."""
    cluster.kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--ignore-not-found", "--wait=true",
                    f"--timeout={WAIT_S}s")
    ns = cluster.namespace("hg-crd")
    args = ["install", RELEASE, str(CHART), "-n", ns, "--set", "metrics.serviceMonitor.enabled=true"]
    r = cluster.helm(*args, check=False)
    assert r.returncode != 0
    assert re.search(r"no matches for kind \"ServiceMonitor\"|ensure CRDs are installed first", r.stderr), r.stderr
    assert cluster.get("statefulsets", ns) == []  # refused before anything was created
    install_crd(cluster, servicemonitor_crd)
    cluster.helm(*args)
    assert len(cluster.get("servicemonitors.monitoring.coreos.com", ns)) == 1
    cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", f"--timeout={WAIT_S}s")


def test_server_refuses_what_offline_validation_accepts(cluster, tmp_path):
    """A negative control: a chart change that only a real server refuses (a PodDisruptionBudget
    with both minAvailable and maxUnavailable passes the JSON schemas) fails this tier."""
    chart = tmp_path / "hourglass"
    shutil.copytree(CHART, chart)
    t = chart / "templates" / "metaserver.yaml"
    text = t.read_text()
    assert "minAvailable:" in text
    t.write_text(re.sub(r"(\n(\s+)minAvailable:[^\n]*)", r"\1\n\2maxUnavailable: 1", text, count=1))
    ns = cluster.namespace("hg-broken")
    rendered = cluster.helm("template", RELEASE, str(chart), "-n", ns).stdout
    pdb = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PodDisruptionBudget"
               and "metaserver" in d["metadata"]["name"])
    assert {"minAvailable", "maxUnavailable"} <= set(pdb["spec"])
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    if kubernetes_validate is not None:
        kubernetes_validate.validate(pdb, "1.37.0", strict=True)  # offline: accepted
    r = cluster.kubectl("apply", "-n", ns, "--dry-run=server", "--validate=strict", "-f", "-", input=rendered,
                        check=False)
    assert r.returncode != 0 and "minAvailable" in r.stderr and "maxUnavailable" in r.stderr, r.stderr
    r = cluster.helm("install", RELEASE, str(chart), "-n", ns, check=False)
    assert r.returncode != 0 and "PodDisruptionBudget" in r.stderr, r.stderr


# ------------------------------------------------------------------ level 3: a kubelet runs pods


@pytest.fixture(scope="module")
def node(cluster):
    """A kubelet with containerd and runc (Debian) joins the cluster; last in this module, so the
    level-2 pods above never had a node. Stopped with the cluster."""
    r = subprocess.run(["bash", str(SCRIPT), "node-up", str(cluster.dir)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "K8S_READY_TIMEOUT_S": "120"})
    if r.returncode != 0:
        pytest.skip(f"`bash scripts/k8s-local.sh node-up` refused: {r.stderr.strip()[-800:]}")
    env = dict(line.split("=", 1) for line in (cluster.dir / "env").read_text().splitlines() if "=" in line)
    return env


def _task_pid(node_env: dict, container_id: str) -> int:
    r = subprocess.run(["ctr", "--address", node_env["CONTAINERD_ADDRESS"], "-n", "k8s.io", "tasks", "ls"],
                       capture_output=True, text=True, timeout=30)
    for line in r.stdout.splitlines():
        f = line.split()
        if f and f[0] == container_id and f[2] == "RUNNING":
            return int(f[1])
    raise AssertionError(f"no running task {container_id}: {r.stdout}")


def test_pods_run_and_come_back_after_kill_9(cluster, node):
    """Level 3 as far as it goes here: a pod under Pod Security `restricted` really runs (runc,
    a pod IP from the bridge network, the sandbox image built here); `kill -9` of its process is
    answered by the kubelet with a restart; deleting the pod stops the process."""
    ns = cluster.namespace("hg-node")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper", "namespace": ns},
           "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "imagePullPolicy": "Never",
                                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                        "capabilities": {"drop": ["ALL"]}}}]}}
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/sleeper", f"--timeout={WAIT_S}s")
    print(f"k8s: pod Ready {time.monotonic() - t0:.1f} s after create")
    (p,) = cluster.get("pods", ns)
    assert p["spec"]["nodeName"] == node["K8S_NODE"]
    assert p["status"]["podIP"].startswith("10.244."), p["status"]
    cid = p["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    pid = _task_pid(node, cid)
    assert Path(f"/proc/{pid}/status").read_text().count("10001") >= 1  # runs as the pod's uid

    os.kill(pid, 9)
    def restarted():
        (q,) = cluster.get("pods", ns)
        st = q["status"]["containerStatuses"][0]
        return st["restartCount"] >= 1 and st.get("ready") and q
    q = wait_until(restarted, "container restarted by the kubelet after kill -9")
    new = _task_pid(node, q["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://"))
    assert new != pid

    cluster.kubectl("delete", "pod", "-n", ns, "sleeper", "--wait=true", f"--timeout={WAIT_S}s")
    wait_until(lambda: not Path(f"/proc/{new}").exists(), "the container process gone after the pod's deletion")


# ------------------------------------------------------------------ level 3: the chart's own pods

LOCAL_VALUES = CHART / "ci" / "local-node-values.yaml"
PODS_NS = "hg-pods"
IMAGE = os.environ.get("HOURGLASS_IMAGE", "hourglass:dev")
PROBE_SEND_MAX_S = 45  # a probe stops sending after this long even if it never saw an outage
PROBE_TAIL_S = 5  # ... or this long after the first acknowledgement that ends an outage
PROBE_OUTAGE_S = 1.0  # an outage: a send refused, or this long without an acknowledgement
PROBE_DELAY_MS = 1000  # every message goes through the delay group: due 1 s after its send
PROBE_DRAIN_S = 30  # after the last send, the wait for every acknowledged message to arrive

# Runs inside a pod of the Hourglass image (the chart's meta server Service as HOURGLASS_META_SERVERS):
# sends one delayed message every 50 ms, consumes and acks them, prints one JSON line per event
# (and the delay group's master whenever the meta server names another). It stops sending
# PROBE_TAIL_S after the first acknowledgement that ends an outage (the first one after the
# first 40 acknowledgements, when the cluster was steady), or after PROBE_SEND_MAX_S; then
# waits for every acknowledged message and prints a summary.
PROBE = r'''
import asyncio, json, os, sys, time
from cluster.client import Consumer, Producer
from cluster.discovery import MetaResolver

META = os.environ["HOURGLASS_META_SERVERS"]
SUBJECT, SEND_MAX_S, TAIL_S, OUTAGE_S, DELAY_MS, DRAIN_S = sys.argv[1], *map(float, sys.argv[2:7])
INTERVAL_S, STEADY_ACKS = 0.05, 40
acked, received, state = {}, set(), {"master": None, "done": False, "errors": 0}


def out(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)


async def watch_master():
    r = MetaResolver(META, refresh_ms=100, refresh_min_ms=100, timeout_s=1.0)
    while not state["done"]:
        try:
            groups = dict(await r.delay_groups())
        except Exception as e:
            groups = {}
            out(ev="meta_err", error=f"{type(e).__name__}: {str(e)[:200]}")
        master = groups.get("d1") or None
        if master != state["master"]:
            state["master"] = master
            out(ev="master", master=master)
        await asyncio.sleep(0.1)
    await r.close()


async def produce():
    r = MetaResolver(META, refresh_ms=1000, refresh_min_ms=100, timeout_s=1.0)
    async with Producer(r, timeout_s=1.0, call_timeout_s=2.0) as p:
        t_start, i, last_ack, refused, resumed = time.time(), 0, None, False, None
        while time.time() - t_start < SEND_MAX_S and not (resumed and time.time() - resumed > TAIL_S):
            mid, t0 = f"{SUBJECT}-{i}", time.time()
            i += 1
            try:
                res = await p.send_and_wait(SUBJECT, b"probe", delay_ms=int(DELAY_MS), id=mid)
                acked[mid] = res.deliver_at_ms
                now = time.time()
                out(ev="ack", id=mid, sent=t0, due_ms=res.deliver_at_ms)
                outage = refused or (last_ack is not None and now - last_ack >= OUTAGE_S)
                if outage and resumed is None and len(acked) > STEADY_ACKS:
                    resumed = now
                    out(ev="resumed", after_s=round(now - last_ack, 3))
                last_ack, refused = now, False
            except Exception as e:
                state["errors"] += 1
                refused = True
                out(ev="err", id=mid, sent=t0, error=f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(max(0.0, INTERVAL_S - (time.time() - t0)))
    await r.close()
    state["done"] = True


async def consume():
    r = MetaResolver(META, refresh_ms=1000, refresh_min_ms=100, timeout_s=1.0)
    async with Consumer(r, SUBJECT, group="probe", wait_ms=300, timeout_s=2.0, call_timeout_s=3.0) as c:
        drain_until = None
        while True:
            try:
                batch = await c.pull()
                for m in batch:
                    if m.id not in received:
                        out(ev="recv", id=m.id, lateness_ms=m.lateness_ms)
                    received.add(m.id)
                await c.ack(batch)
            except Exception as e:
                out(ev="pull_err", error=f"{type(e).__name__}: {str(e)[:200]}")
                await asyncio.sleep(0.2)
            if state["done"]:
                drain_until = drain_until or time.time() + DRAIN_S
                if set(acked) <= received or time.time() > drain_until:
                    break
    await r.close()


async def main():
    await asyncio.gather(watch_master(), produce(), consume())
    lost = sorted(set(acked) - received)
    out(ev="summary", acked=len(acked), received=len(received), lost=len(lost), lost_ids=lost[:20],
        errors=state["errors"])


asyncio.run(main())
'''


def _pod_log(node_env: dict, ns: str, pod: dict, container: str) -> list[dict]:
    """A pod's stdout JSON lines, read from the kubelet's log folder (the API server cannot reach
    this kubelet: it serves on 127.0.0.1 only, so `kubectl logs` has no way in)."""
    m = pod["metadata"]
    d = Path(node_env["POD_LOGS"]) / f"{ns}_{m['name']}_{m['uid']}" / container
    out = []
    for f in sorted(d.glob("*.log")) if d.is_dir() else []:
        for line in f.read_text().splitlines():
            parts = line.split(" ", 3)  # CRI format: time stream tag text
            if len(parts) == 4 and parts[1] == "stdout" and parts[3].startswith("{"):
                try:
                    out.append(json.loads(parts[3]))
                except json.JSONDecodeError:
                    pass
    return out


def _elections(node_env: dict, ns: str, since: float) -> list[str]:
    """The meta servers' `elected` log lines (who won which group, epoch) from `since` on."""
    out = []
    for f in Path(node_env["POD_LOGS"]).glob(f"{ns}_*-metaserver-*/metaserver/*.log"):
        for line in f.read_text().splitlines():
            t, _, text = line.partition(" ")
            if " elected " in text:
                try:
                    when = datetime.datetime.fromisoformat(t[:26] + "+00:00").timestamp()
                except ValueError:
                    continue
                if when >= since:
                    out.append(f"+{when - since:.2f} s " + text.split(" elected ", 1)[1])
    return sorted(out)


def static_volumes(cluster: Cluster, ns: str, claims: list[str], size: str) -> None:
    """A hostPath PersistentVolume bound in advance to each claim (there is no provisioner), its
    folder owned by the image's uid (the kubelet applies no fsGroup to hostPath volumes)."""
    root = cluster.dir / "node" / "volumes" / ns
    docs = []
    for c in claims:
        d = root / c
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, 10001, 10001)
        docs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-{c}"},
                     "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                              "persistentVolumeReclaimPolicy": "Retain", "claimRef": {"namespace": ns, "name": c},
                              "hostPath": {"path": str(d), "type": "Directory"}}})
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


@pytest.fixture(scope="module")
def image(node, cluster):
    """hourglass:dev built by scripts/image.sh (Docker, nothing pulled) and imported into the node's
    containerd. A Docker daemon this session started is stopped once, at the session's end
    (conftest.py): a stop per module took it from under another module's build."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh"), "build"], capture_output=True, text=True,
                       timeout=1200, cwd=ROOT, env={**os.environ, "HOURGLASS_IMAGE": IMAGE}, check=False)
    if "image.sh: SKIP:" in r.stdout:
        pytest.skip("`bash scripts/image.sh build` refused: " + r.stdout.split("image.sh: SKIP:", 1)[1].strip())
    assert r.returncode == 0, f"scripts/image.sh build failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    r = subprocess.run(["bash", str(SCRIPT), "node-image", str(cluster.dir)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HOURGLASS_IMAGE": IMAGE}, check=False)
    assert r.returncode == 0, f"`k8s-local.sh node-image` failed:\n{r.stderr[-3000:]}"
    return IMAGE


def _pod(cluster: Cluster, ns: str, name: str) -> dict | None:
    r = cluster.kubectl("get", "pod", "-n", ns, name, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def _ready(p: dict | None) -> bool:
    return bool(p) and "deletionTimestamp" not in p["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))


CLIENT_ENV = {"TLS_CA_FILE": "/client/tls/ca.crt", "TLS_CERT_FILE": "/client/tls/tls.crt",
              "TLS_KEY_FILE": "/client/tls/tls.key", "TOKEN_FILE": "/client/token/token"}


def run_probe(cluster: Cluster, node_env: dict, ns: str, name: str, fault) -> dict:
    """Starts a probe pod, calls fault(master_pod_name) once the probe has 40 acknowledgements,
    and returns what the probe saw: events, the fault time, the summary."""
    meta = f"{RELEASE}-hourglass-metaserver.{ns}.svc.cluster.local:7100"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
           "spec": {"restartPolicy": "Never", "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "probe", "image": IMAGE, "imagePullPolicy": "Never",
                                    "command": ["/opt/hourglass/bin/python", "/probe/probe.py", name,
                                                str(PROBE_SEND_MAX_S), str(PROBE_TAIL_S), str(PROBE_OUTAGE_S),
                                                str(PROBE_DELAY_MS),
                                                str(PROBE_DRAIN_S)],
                                    # the chart is secure by default: the client Secrets it made
                                    # (docs/security.md), mounted as a user's client would
                                    "env": [{"name": "HOURGLASS_META_SERVERS", "value": meta},
                                            *({"name": f"HOURGLASS_{k}", "value": v} for k, v in CLIENT_ENV.items()),
                                            {"name": "HOURGLASS_TLS_SERVER_NAME", "valueFrom": {"secretKeyRef": {
                                                "name": f"{RELEASE}-hourglass-client-token", "key": "server-name"}}}],
                                    "volumeMounts": [{"name": "probe", "mountPath": "/probe"},
                                                     {"name": "client-tls", "mountPath": "/client/tls"},
                                                     {"name": "client-token", "mountPath": "/client/token"}],
                                    "securityContext": {"allowPrivilegeEscalation": False,
                                                        "readOnlyRootFilesystem": True,
                                                        "capabilities": {"drop": ["ALL"]}}}],
                    "volumes": [{"name": "probe", "configMap": {"name": "probe"}},
                                {"name": "client-tls", "secret": {"secretName": f"{RELEASE}-hourglass-client-tls"}},
                                {"name": "client-token",
                                 "secret": {"secretName": f"{RELEASE}-hourglass-client-token"}}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    p = wait_until(lambda: (q := _pod(cluster, ns, name)) and q["metadata"].get("uid") and q, f"pod {name}")
    acks = wait_until(lambda: len([e for e in _pod_log(node_env, ns, p, "probe") if e["ev"] == "ack"]) >= 40,
                      f"{name}: 40 acknowledged sends")
    del acks
    events = _pod_log(node_env, ns, p, "probe")
    master = [e["master"] for e in events if e["ev"] == "master"][-1]
    assert master, f"{name}: no delay master: {events[-5:]}"
    victim = master.split(".", 1)[0]  # <pod>.<group service>.<ns>.svc...:port
    t_fault = time.time()
    fault(victim)
    deadline = PROBE_SEND_MAX_S + PROBE_DRAIN_S + 30
    wait_until(lambda: (_pod(cluster, ns, name) or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
               f"{name} finished", timeout_s=deadline)
    events = _pod_log(node_env, ns, p, "probe")
    summaries = [e for e in events if e["ev"] == "summary"]
    assert summaries, f"{name}: no summary; last lines: {events[-10:]}"
    return {"events": events, "t_fault": t_fault, "victim": victim, "summary": summaries[-1]}


def failover_figures(run: dict) -> dict:
    """From the fault on: the longest stretch without an acknowledged send (sends_gap_s) and when
    it ended (sends_resume_s, seconds after the fault), the same for receives, the lateness of
    messages due after the fault, and the delay masters the meta server named."""
    ev, tf = run["events"], run["t_fault"]

    def gap(ts: list[float]) -> tuple[float, float] | tuple[None, None]:
        ts = [tf] + [t for t in ts if t >= tf]
        if len(ts) < 2:
            return None, None
        g, end = max((b - a, b) for a, b in itertools.pairwise(ts))
        return round(g, 2), round(end - tf, 2)
    acks = [e for e in ev if e["ev"] == "ack"]
    recvs = [e for e in ev if e["ev"] == "recv"]
    due = {e["id"]: e["due_ms"] / 1000 for e in acks}
    late = sorted(e["lateness_ms"] for e in recvs if due.get(e["id"], 0) >= tf)
    sends_gap, sends_resume = gap([e["t"] for e in acks])
    recv_gap, recv_resume = gap([e["t"] for e in recvs])
    return {"sends_gap_s": sends_gap, "sends_resume_s": sends_resume, "receives_gap_s": recv_gap,
            "receives_resume_s": recv_resume, "lateness_max_ms": late[-1] if late else None,
            "acked": run["summary"]["acked"], "lost": run["summary"]["lost"], "send_errors": run["summary"]["errors"],
            "masters_after": [(e["master"] or "-").split(".", 1)[0] for e in ev if e["ev"] == "master" and e["t"] > tf]}


def test_chart_pods_run_deliver_and_fail_over(cluster, node, image, record_property):
    """Level 3 with the chart's own pods: `helm install` with ci/local-node-values.yaml brings up
    etcd, the meta server and the delay and real-time groups from the image built here; a probe pod
    sends and consumes through them; deleting the delay master pod, then `kill -9` of the new
    master's process, is followed by deliveries resuming with no acknowledged message lost."""
    ns = cluster.namespace(PODS_NS)
    values = yaml.safe_load(LOCAL_VALUES.read_text())
    claims = [f"data-{RELEASE}-hourglass-etcd-{i}" for i in range(values["etcd"]["replicas"])]
    for role, groups in (("delay", values["delayGroups"]), ("realtime", values["realtimeGroups"])):
        claims += [f"data-{RELEASE}-hourglass-{role}-{g['name']}-{i}" for g in groups for i in range(g["replicas"])]
    static_volumes(cluster, ns, claims, "1Gi")
    cluster.kubectl("create", "configmap", "probe", "-n", ns, "--from-literal", f"probe.py={PROBE}")
    t0, t_install = time.monotonic(), time.time()
    cluster.helm("install", RELEASE, str(CHART), "-n", ns, "-f", str(LOCAL_VALUES))
    want = VALUES["local-node"][1]
    # `kubectl wait --all` waits for the pods that exist when it starts; a controller slow to
    # create the rest (a busy machine) leaves some out, so wait for all `want` of them, each Ready
    deadline = time.monotonic() + WAIT_S
    while True:
        r = cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod", "--all",
                            f"--timeout={max(1, int(deadline - time.monotonic()))}s", check=False)
        pods = cluster.get("pods", ns)
        if (r.returncode == 0 and len(pods) == want and all(map(_ready, pods))) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0 and len(pods) == want and all(map(_ready, pods)), (
        f"chart pods not Ready within {WAIT_S} s: {r.stderr}\n"
        + "\n".join(f"{p['metadata']['name']}: {p['status'].get('phase')} "
                    f"{[c.get('state') for c in p['status'].get('containerStatuses', [])]}" for p in pods))
    ready_s = time.monotonic() - t0
    record_property("helm_install_to_ready_s", round(ready_s, 1))
    print(f"k8s: helm install to {want} chart pods Ready in {ready_s:.1f} s")
    for p in pods:
        assert p["spec"]["nodeName"] == node["K8S_NODE"]
        assert p["status"].get("podIP", "").startswith("10.244."), p["status"]

    # 1. delete the delay master pod (graceful: SIGTERM, the grace period, the StatefulSet makes it again)
    def delete(victim):
        cluster.kubectl("delete", "pod", "-n", ns, victim, "--wait=false")
    run = run_probe(cluster, node, ns, "probe-delete", delete)
    fig = failover_figures(run)
    print(f"k8s: delete pod {run['victim']}: {fig}; elections: {_elections(node, ns, run['t_fault'])}")
    record_property("delete_master_pod", json.dumps(fig))
    assert fig["lost"] == 0, f"acknowledged messages lost after deleting {run['victim']}: {run['summary']}"
    first = min(e["t"] for e in run["events"] if e["ev"] == "recv") - t_install
    record_property("helm_install_to_first_delivery_s", round(first, 1))
    print(f"k8s: helm install to the first message delivered through the chart's pods: {first:.1f} s")
    # sends were acknowledged, and messages due after the fault delivered, after the fault
    assert fig["sends_resume_s"] is not None and fig["lateness_max_ms"] is not None, fig
    assert set(fig["masters_after"]) - {"-", run["victim"]}, f"no other delay master after deleting {run['victim']}: {fig}"
    wait_until(lambda: _ready(_pod(cluster, ns, run["victim"])), f"{run['victim']} made again and Ready")

    # 2. kill -9 of the (new) delay master's process: the kubelet restarts the container
    def kill_9(victim):
        p = _pod(cluster, ns, victim)
        cid = p["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
        os.kill(_task_pid(node, cid), 9)
    run = run_probe(cluster, node, ns, "probe-kill9", kill_9)
    fig = failover_figures(run)
    print(f"k8s: kill -9 of {run['victim']}: {fig}; elections: {_elections(node, ns, run['t_fault'])}")
    record_property("kill_9_master", json.dumps(fig))
    assert fig["lost"] == 0, f"acknowledged messages lost after kill -9 of {run['victim']}: {run['summary']}"
    assert fig["sends_resume_s"] is not None and fig["lateness_max_ms"] is not None, fig
    p = wait_until(lambda: (q := _pod(cluster, ns, run["victim"])) and _ready(q) and q, f"{run['victim']} Ready again")
    assert p["status"]["containerStatuses"][0]["restartCount"] >= 1  # the same pod, its container restarted
    cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", f"--timeout={WAIT_S}s")
