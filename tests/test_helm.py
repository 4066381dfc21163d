"""The Helm chart, rendered by a real helm and checked the way an API server would.

helm is built from source with ``go install`` (scripts/helm-tools.sh, cached between runs);
every rendered manifest is validated offline with ``kubernetes-validate --strict`` against
Kubernetes 1.30 and 1.37; the objects of several values files are asserted on; bad values
must be refused at install time with a message that names the offending key.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.tools import helm_binary

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "hourglass"
VALUES = {
    "default": [],
    "large": [CHART / "ci" / "large-values.yaml"],
    "external-etcd": [CHART / "ci" / "external-etcd-values.yaml"],
}
KUBE_VERSIONS = ["1.30.0", "1.37.0"]
RELEASE, NAMESPACE = "hg", "brokers"
DOMAIN = f"{NAMESPACE}.svc.cluster.local"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # not in Kubernetes' own schemas; asserted on below instead


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


def run_helm(helm: str, *args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, cwd=chart.parent)


def render(helm: str, values: list[Path] = (), sets: list[str] = (), kube: str = "1.37.0",
           chart: Path = CHART) -> list[dict]:
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args, chart=chart)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


# ------------------------------------------------------------------ lint and offline validation


@pytest.mark.parametrize("name", sorted(VALUES))
def test_helm_lint(helm, name):
    args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    for v in VALUES[name]:
        args += ["-f", str(v)]
    r = run_helm(helm, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(VALUES))
def test_rendered_manifests_pass_strict_validation(helm, tmp_path, name, kube):
    objs = render(helm, VALUES[name], kube=kube)
    out = tmp_path / "manifests.yaml"
    out.write_text(yaml.safe_dump_all(objs))
    r = subprocess.run(["kubernetes-validate", "--strict", "-k", kube, str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERROR" not in r.stdout
    passed = re.findall(r"^INFO .* passed for resource (\S+) against version (\S+)$", r.stdout, re.M)
    core = [o for o in objs if o["kind"] not in CRD_KINDS]
    assert len(passed) == len(core), r.stdout
    assert {v for _, v in passed} == {kube.rsplit(".", 1)[0]}, "validated against another version than asked"
    warned = re.findall(r"^WARN .*kind (\S+) with api version", r.stdout, re.M)
    assert set(warned) <= CRD_KINDS, r.stdout


def test_strict_validation_rejects_an_unknown_field(helm, tmp_path):
    """Negative control: the validation above can fail."""
    objs = render(helm)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    container(sts)["livenesProbe"] = {"grpc": {"port": 7000}}  # typo a user could make in a fork
    out = tmp_path / "bad.yaml"
    out.write_text(yaml.safe_dump(sts))
    r = subprocess.run(["kubernetes-validate", "--strict", "-k", "1.30.0", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "livenesProbe" in r.stdout, r.stdout


# ------------------------------------------------------------------ objects of each values file


def test_default_install(helm):
    objs = render(helm)
    sts = by_kind(objs, "StatefulSet")
    assert set(sts) == {"hg-hourglass-delay-d1", "hg-hourglass-realtime-r1", "hg-hourglass-etcd"}
    d1 = sts["hg-hourglass-delay-d1"]
    assert d1["spec"]["replicas"] == 2  # master + one slave
    assert d1["spec"]["serviceName"] == "hg-hourglass-delay-d1"
    assert d1["spec"]["podManagementPolicy"] == "Parallel"
    c = container(d1)
    assert c["image"] == "hourglass:0.1.0"
    assert c["args"][:2] == ["node", "--role=delay"]
    env = env_of(c)
    assert env["HOURGLASS_ROLE"] == "delay" and env["HOURGLASS_GROUP"] == "d1"
    # node id = pod name; master comes from the election, so nothing depends on the ordinal
    assert env["HOURGLASS_NODE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["HOURGLASS_ADVERTISE"] == f"$(HOURGLASS_NODE_ID).hg-hourglass-delay-d1.{DOMAIN}:7000"
    assert json.loads(env["HOURGLASS_META_SERVERS"]) == [f"hg-hourglass-metaserver.{DOMAIN}:7100"]
    assert env["HOURGLASS_ACK_MODE"] == "async"
    assert env["HOURGLASS_REPLICATED"] == "true"  # master chosen by election, not by pod name
    assert env["HOURGLASS_DATA_DIR"] == "/var/lib/hourglass" and env["HOURGLASS_METRICS_PORT"] == "9100"
    # /metrics on the pod IP (the port the Service, ServiceMonitor and NetworkPolicy name), not loopback
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}} and env["HOURGLASS_METRICS_HOST"] == "$(POD_IP)"
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("HOURGLASS_METRICS_HOST")  # Kubernetes expands $(VAR) in order
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 7001}, probe  # plaintext health only: the node port is mutual TLS
    assert c["readinessProbe"]["grpc"] == {"port": 7001, "service": "hourglass.v1.Node"}  # registered
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert d1["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {
        "data": "/var/lib/hourglass", "tmp": "/tmp", "tls": "/etc/hourglass/tls", "auth": "/etc/hourglass/auth",
        "client-ca": "/etc/hourglass/client-ca"}
    (pvc,) = d1["spec"]["volumeClaimTemplates"]
    assert pvc["metadata"]["name"] == "data"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert "storageClassName" not in pvc["spec"]  # the cluster's default class
    aff = d1["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert aff[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]["hourglass.io/group"] == "d1"
    assert container(sts["hg-hourglass-realtime-r1"])["args"][:2] == ["node", "--role=realtime"]

    svc = by_kind(objs, "Service")
    for name in ("hg-hourglass-delay-d1", "hg-hourglass-realtime-r1", "hg-hourglass-etcd-headless",
                 "hg-hourglass-metaserver-headless"):
        assert svc[name]["spec"]["clusterIP"] == "None", name
    assert svc["hg-hourglass-delay-d1"]["spec"]["publishNotReadyAddresses"] is True
    assert svc["hg-hourglass-delay-d1"]["spec"]["selector"] == d1["spec"]["selector"]["matchLabels"]

    ms = by_kind(objs, "Deployment")["hg-hourglass-metaserver"]
    assert ms["spec"]["replicas"] == 2
    mc = container(ms)
    members = ",".join(f"hg-hourglass-etcd-{i}.hg-hourglass-etcd-headless.{DOMAIN}:2379" for i in range(3))
    assert mc["args"] == ["metaserver", "--host=0.0.0.0", "--port=7100", f"--etcd-endpoints={members}"]
    assert mc["livenessProbe"]["grpc"] == {"port": 7101}  # "" = the process answers
    assert mc["readinessProbe"]["grpc"] == {"port": 7101, "service": "hourglass.meta.v1.Meta"}  # etcd reachable

    pdb = by_kind(objs, "PodDisruptionBudget")
    assert pdb["hg-hourglass-metaserver"]["spec"]["minAvailable"] == 1
    assert pdb["hg-hourglass-delay-d1"]["spec"]["maxUnavailable"] == 1
    assert pdb["hg-hourglass-delay-d1"]["spec"]["selector"] == d1["spec"]["selector"]

    etcd = sts["hg-hourglass-etcd"]
    assert etcd["spec"]["replicas"] == 3
    ec = container(etcd)
    assert ec["image"] == "quay.io/coreos/etcd:v3.5.17"
    cluster = next(a for a in ec["args"] if a.startswith("--initial-cluster="))
    assert cluster.count("=https://") == 3 and f"hg-hourglass-etcd-2.hg-hourglass-etcd-headless.{DOMAIN}:2380" in cluster
    # etcd's plaintext /health and /metrics on the pod IP, not 0.0.0.0
    assert "--listen-metrics-urls=http://$(POD_IP):2381" in ec["args"]
    # heartbeats write a revision each: the history is compacted, or etcd's quota fills up
    assert {"--auto-compaction-mode=periodic", "--auto-compaction-retention=1h"} <= set(ec["args"])
    assert env_of(ec)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "ServiceMonitor" not in {o["kind"] for o in objs}
    mcenv = env_of(mc)
    assert (mcenv["HOURGLASS_META_METRICS_HOST"], mcenv["HOURGLASS_META_METRICS_PORT"]) == ("$(POD_IP)", "7102")
    # no pod talks to the Kubernetes API: no service account token in any of them
    pods = list(sts.values()) + [ms]
    assert [p["spec"]["template"]["spec"]["automountServiceAccountToken"] for p in pods] == [False] * len(pods)


def test_large_install(helm):
    objs = render(helm, VALUES["large"])
    sts = by_kind(objs, "StatefulSet")
    want = {"hg-hourglass-delay-d1": 3, "hg-hourglass-delay-d2": 2, "hg-hourglass-delay-d3": 4,
            "hg-hourglass-realtime-r1": 3, "hg-hourglass-realtime-r2": 2, "hg-hourglass-etcd": 5}
    assert {n: s["spec"]["replicas"] for n, s in sts.items()} == want
    env = {n: env_of(container(s)) for n, s in sts.items() if "etcd" not in n}
    assert env["hg-hourglass-delay-d1"]["HOURGLASS_ACK_MODE"] == "sync"  # chart-wide
    assert env["hg-hourglass-delay-d3"]["HOURGLASS_ACK_MODE"] == "async"  # group override
    assert env["hg-hourglass-delay-d2"]["HOURGLASS_DISPATCH_CONCURRENCY_MAX"] == "16"  # extraEnv
    assert env["hg-hourglass-realtime-r2"]["HOURGLASS_GROUP"] == "r2"

    def pvc(name):
        (t,) = sts[name]["spec"]["volumeClaimTemplates"]
        return t["spec"]["storageClassName"], t["spec"]["resources"]["requests"]["storage"]
    assert pvc("hg-hourglass-delay-d1") == ("fast-ssd", "100Gi")
    assert pvc("hg-hourglass-delay-d2") == ("fast-ssd", "500Gi")  # size overridden, class inherited
    assert container(sts["hg-hourglass-delay-d2"])["resources"]["limits"]["memory"] == "8Gi"
    assert container(sts["hg-hourglass-delay-d1"])["resources"]["limits"]["memory"] == "1Gi"

    spec = sts["hg-hourglass-realtime-r1"]["spec"]["template"]["spec"]
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["hourglass.io/group"] == "r1"
    assert spec["nodeSelector"] == {"workload": "brokers"} and spec["tolerations"][0]["key"] == "dedicated"
    assert spec["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert container(sts["hg-hourglass-realtime-r1"])["image"] == "registry.example.com/hourglass:0.1.0-rc1"
    assert container(sts["hg-hourglass-etcd"])["image"] == "registry.example.com/etcd:v3.5.17"
    assert by_kind(objs, "Deployment")["hg-hourglass-metaserver"]["spec"]["replicas"] == 3
    assert len(by_kind(objs, "PodDisruptionBudget")) == 1 + 5 + 1  # meta servers, groups, etcd

    (sm,) = by_kind(objs, "ServiceMonitor").values()
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["interval"] == "30s"

    def selected(labels: dict) -> bool:  # a label selector as the Prometheus Operator reads it
        sel = sm["spec"]["selector"]
        return sel["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []) if e["operator"] == "In")
    scraped = [s for s in by_kind(objs, "Service").values()
               if selected(s["metadata"]["labels"]) and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert sorted(s["metadata"]["name"] for s in scraped) == sorted(
        [n for n in want if "etcd" not in n] + ["hg-hourglass-metaserver-headless"])


def test_external_etcd_install(helm):
    objs = render(helm, VALUES["external-etcd"])
    assert not [o for o in objs if "etcd" in o["metadata"]["name"]]
    assert "PodDisruptionBudget" not in {o["kind"] for o in objs}
    mc = container(by_kind(objs, "Deployment")["hg-hourglass-metaserver"])
    assert "--etcd-endpoints=etcd-0.etcd.infra.svc:2379,etcd-1.etcd.infra.svc:2379" in mc["args"]
    sts = by_kind(objs, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sts.items()} == {"hg-hourglass-delay-d1": 1,
                                                                  "hg-hourglass-realtime-r1": 1}
    d1 = sts["hg-hourglass-delay-d1"]["spec"]
    assert "affinity" not in d1["template"]["spec"]
    assert d1["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Delete"}


# ------------------------------------------------------------------ the chart matches the real CLI and settings


def _cli_options(command: str) -> set[str]:
    import typer.main

    from cluster.cli import app
    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


def test_node_container_is_accepted_by_cli_and_settings(helm, monkeypatch):
    """What Kubernetes would start: every flag exists on `hourglass node`, every HOURGLASS_*
    variable (after Kubernetes' substitutions) lands in NodeSettings."""
    from node.config import NodeSettings

    objs = render(helm, VALUES["large"])
    sts = by_kind(objs, "StatefulSet")["hg-hourglass-realtime-r2"]
    c = container(sts)
    pod = "hg-hourglass-realtime-r2-1"
    resolved = _resolve_env(c, {"metadata.name": pod, "status.podIP": "10.1.2.3"})
    assert resolved.pop("POD_IP") == "10.1.2.3"  # for $(POD_IP) only, not a setting
    flags = [a.split("=", 1)[0] for a in c["args"][1:]]
    assert c["args"][0] == "node" and set(flags) <= _cli_options("node"), flags
    for k in list(__import__("os").environ):
        if k.startswith("HOURGLASS_"):
            monkeypatch.delenv(k)
    for k, v in resolved.items():
        monkeypatch.setenv(k, v)
    s = NodeSettings()
    sv = s.server
    assert (sv.role, sv.node_id, sv.group, sv.port, sv.metrics_port) == ("realtime", pod, "r2", 7000, 9100)
    assert sv.metrics_host == "10.1.2.3"  # the pod IP
    assert sv.advertise == f"{pod}.hg-hourglass-realtime-r2.{DOMAIN}:7000"
    assert s.meta.servers == [f"hg-hourglass-metaserver.{DOMAIN}:7100"]
    assert str(sv.data_dir) == "/var/lib/hourglass" and sv.host == "0.0.0.0"
    assert s.delay.dispatch_concurrency_max == 16
    assert s.replication.ack_mode == "sync"
    from cluster.security import SecuritySettings
    from node.config import FLAT_NAMES

    sec = SecuritySettings()
    assert sec.tls and sec.tls_server_name == "hg-hourglass.brokers.hourglass"
    assert str(sec.auth_file) == "/etc/hourglass/auth/auth.json" and sv.health_port == 7001
    known = {f"HOURGLASS_{f.upper()}" for f in [*FLAT_NAMES, *SecuritySettings.model_fields]}
    assert set(resolved) <= known, set(resolved) - known


def _resolve_env(c: dict, fields: dict[str, str]) -> dict[str, str]:
    """A container's env as Kubernetes hands it over: fieldRefs filled in, $(VAR) expanded in order."""
    resolved: dict[str, str] = {}
    for e in c["env"]:
        v = fields[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e["value"]
        resolved[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: resolved[m.group(1)], v)
    return resolved


def test_metaserver_container_is_accepted_by_cli_and_settings(helm, monkeypatch):
    from metaserver.config import MetaSettings

    objs = render(helm, VALUES["external-etcd"])
    c = container(by_kind(objs, "Deployment")["hg-hourglass-metaserver"])
    assert c["args"][0] == "metaserver"
    flags = dict(a.split("=", 1) for a in c["args"][1:])
    assert set(flags) <= _cli_options("metaserver"), flags
    env = _resolve_env(c, {"status.podIP": "10.1.2.3"})
    for k in list(__import__("os").environ):
        if k.startswith("HOURGLASS_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # the CLI hands its flags over as these overrides (cluster/cli/servers.py metaserver)
    s = MetaSettings(host=flags["--host"], port=int(flags["--port"]),
                     etcd_endpoints=flags["--etcd-endpoints"].split(","))
    assert (s.host, s.port, s.advertise) == ("0.0.0.0", 7100, "10.1.2.3:7100")
    assert (s.metrics_host, s.metrics_port) == ("10.1.2.3", 7102)
    assert s.etcd_endpoints == ["etcd-0.etcd.infra.svc:2379", "etcd-1.etcd.infra.svc:2379"]
    assert all(k.removeprefix("HOURGLASS_META_").lower() in MetaSettings.model_fields
               for k in env if k.startswith("HOURGLASS_META_")), env


def test_the_console_is_a_deployment_and_a_service_dialling_with_a_client_certificate(helm):
    """Issue 31: the console beside the meta servers; with security on it dials the nodes with the
    client certificate (never the node one, which may do everything whatever the viewer's token)
    and serves HTTPS only, its probes too; with security off, plain HTTP; disabled, nothing."""
    objs = render(helm)
    dep = by_kind(objs, "Deployment")["hg-hourglass-console"]
    assert dep["spec"]["replicas"] == 1
    c = container(dep)
    assert c["args"][0] == "console"
    flags = dict(a.split("=", 1) for a in c["args"][1:])
    assert set(flags) <= _cli_options("console"), flags
    assert flags["--meta"] == "hg-hourglass-metaserver.brokers.svc.cluster.local:7100"
    vols = {v["name"]: v["secret"]["secretName"] for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert vols == {"client": "hg-hourglass-client-tls", "https": "hg-hourglass-console-https",
                    "server-ca": "hg-hourglass-tls"}
    server_ca = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "server-ca")
    assert server_ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the node key
    assert env_of(c)["HOURGLASS_TLS_CERT_FILE"] == "/etc/hourglass/client/tls.crt"
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS" and "--https-cert" in flags
    svc = by_kind(objs, "Service")["hg-hourglass-console"]
    assert svc["spec"]["ports"] == [{"name": "https", "port": 8480, "targetPort": "web"}]
    assert dep["spec"]["template"]["metadata"]["labels"]["hourglass.io/client"] == "true"
    plain = render(helm, sets=["security.enabled=false"])
    pc = container(by_kind(plain, "Deployment")["hg-hourglass-console"])
    assert pc["readinessProbe"]["httpGet"]["scheme"] == "HTTP" and not any("https" in a for a in pc["args"])
    off = render(helm, sets=["console.enabled=false"])
    assert not [o for o in off if "console" in o["metadata"]["name"]]
    # with existing certificates the chart cannot make the console's client certificate: asked for by name
    existing = ["security.certificates=existing", "security.existingSecrets.tls=my-tls",
                "security.existingSecrets.etcd=my-etcd", "security.existingSecrets.etcdClient=my-ec"]
    r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *sum((["--set", s] for s in existing), []))
    assert r.returncode != 0 and "set console.clientTlsSecret" in r.stderr, r.stderr


def test_notes_tell_how_to_send_a_first_message(helm, tmp_path):
    chart = tmp_path / "hourglass"
    shutil.copytree(CHART, chart)
    # helm template does not print NOTES.txt; include it (it is a template like any other) in a ConfigMap
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "hourglass/templates/NOTES.txt" . | quote }}\n')
    objs = render(helm, chart=chart)
    notes = re.sub(r"\\\n\s*", " ", by_kind(objs, "ConfigMap")["notes"]["data"]["notes"])  # join continued lines
    assert f"hg-hourglass-metaserver.{DOMAIN}:7100" in notes
    assert f"hg-hourglass-delay-d1-1.hg-hourglass-delay-d1.{DOMAIN}:7000" in notes
    send = re.search(r"-- send (.*)", notes).group(1)
    consume = re.search(r"-- consume (.*)", notes).group(1)
    send_opts, consume_opts = _cli_options("send"), _cli_options("consume")
    assert set(re.findall(r"--[\w-]+", send)) <= send_opts, send
    assert set(re.findall(r"--[\w-]+", consume)) <= consume_opts, consume
    assert send.split()[0] == consume.split()[0] == "hello.world"
    assert f"--meta hg-hourglass-metaserver.{DOMAIN}:7100" in send and "--meta" in consume


# ------------------------------------------------------------------ bad values are refused


# (--set on a list element replaces the whole element, hence the names)
BAD = [
    (["delayGroups[0].name=d1", "delayGroups[0].replicas=0"], "at '/delayGroups/0/replicas': minimum: got 0, want 1"),
    (["realtimeGroups[0].name=Orders_EU"], "at '/realtimeGroups/0/name'"),
    (["delayGroups[0].name=a-very-long-group-name"], "maxLength"),
    (["nodes.ackMode=eventually"], "at '/nodes/ackMode'"),
    (["etcd.bundled=false"], "at '/etcd/externalEndpoints': minItems"),
    (["etcd.replicas=2"], "at '/etcd/replicas'"),
    (["etcd.bundled=false", "etcd.externalEndpoints[0]=https://etcd:2379"], "at '/etcd/externalEndpoints/0'"),
    (["metaservers.replicas=3"], "additional properties 'metaservers' not allowed"),
    (["nodes.storage.size=lots"], "at '/nodes/storage/size'"),
    (["antiAffinity=sometimes"], "at '/antiAffinity'"),
    (["delayGroups[0].name=d1", "delayGroups[0].ackMode=sync", "delayGroups[0].replicas=1"], "at '/delayGroups/0/replicas'"),
    (["nodes.ackMode=sync", "realtimeGroups[0].name=r1", "realtimeGroups[0].replicas=1"],
     "realtimeGroups[r1]: ackMode sync waits for a slave, so replicas must be at least 2"),
    (["delayGroups[0].name=d1", "delayGroups[0].replicas=2", "delayGroups[1].name=d1", "delayGroups[1].replicas=3"],
     'group name "d1" appears twice'),
]


@pytest.mark.parametrize("sets,message", BAD, ids=[";".join(s) for s, _ in BAD])
def test_bad_values_are_refused(helm, sets, message):
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode != 0, f"accepted: {sets}"
    assert message in r.stderr, r.stderr
    assert r.stdout == ""  # nothing rendered, so nothing would be installed


# ------------------------------------------------------------------ security on by default (issue 18)


def _secrets(objs: list[dict]) -> dict[str, dict[str, bytes]]:
    import base64

    return {n: {k: base64.b64decode(v) for k, v in o["data"].items()} for n, o in by_kind(objs, "Secret").items()}


def test_security_is_on_by_default(helm):
    objs = render(helm)
    sec = _secrets(objs)
    assert set(sec) == {"hg-hourglass-tls", "hg-hourglass-etcd-tls", "hg-hourglass-client-tls", "hg-hourglass-auth",
                        "hg-hourglass-client-token", "hg-hourglass-client-ca", "hg-hourglass-etcd-client-tls",
                        "hg-hourglass-console-https"}
    token = sec["hg-hourglass-client-token"]["token"].decode()
    auth = json.loads(sec["hg-hourglass-auth"]["auth.json"])
    import hashlib

    assert token.startswith("hgt_") and token not in json.dumps(auth)
    assert auth["tokens"][0]["sha256"] == hashlib.sha256(token.encode()).hexdigest()
    sts = by_kind(objs, "StatefulSet")
    for name in ("hg-hourglass-delay-d1", "hg-hourglass-realtime-r1"):
        c = container(sts[name])
        env = env_of(c)
        assert env["HOURGLASS_TLS_CERT_FILE"] == "/etc/hourglass/tls/tls.crt"
        assert env["HOURGLASS_AUTH_FILE"] == "/etc/hourglass/auth/auth.json"
        assert env["HOURGLASS_TLS_SERVER_NAME"] == "hg-hourglass.brokers.hourglass"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == 7001, probe  # the plaintext health port
        vols = {v["name"]: v for v in sts[name]["spec"]["template"]["spec"]["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "hg-hourglass-tls"  # a folder mount: updated in place
        assert all("subPath" not in m for m in c["volumeMounts"])
    ms = by_kind(objs, "Deployment")["hg-hourglass-metaserver"]
    mc = container(ms)
    menv = env_of(mc)
    assert menv["HOURGLASS_META_ETCD_CERT_FILE"] == "/etc/hourglass/etcd-client/tls.crt"
    mvols = {v["name"]: v for v in ms["spec"]["template"]["spec"]["volumes"]}
    assert mvols["etcd-client"]["secret"]["secretName"] == "hg-hourglass-etcd-client-tls"  # not the nodes' certificate
    # servers trust the client CA through its certificate only, never its key
    assert mvols["client-ca"]["secret"] == {"secretName": "hg-hourglass-client-ca", "defaultMode": 0o440,
                                            "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert menv["HOURGLASS_TLS_CLIENT_CA_FILE"] == "/etc/hourglass/client-ca/ca.crt"
    assert mc["readinessProbe"]["grpc"] == {"port": 7101, "service": "hourglass.meta.v1.Meta"}
    ec = container(sts["hg-hourglass-etcd"])
    assert "--client-cert-auth" in ec["args"] and "--peer-client-cert-auth" in ec["args"]
    assert next(a for a in ec["args"] if a.startswith("--listen-client-urls=")).startswith("--listen-client-urls=https://")
    nps = by_kind(objs, "NetworkPolicy")
    assert set(nps) == {"hg-hourglass-servers", "hg-hourglass-etcd"}

    def allowed(policy: dict) -> dict[int, set[str]]:  # port -> components allowed ("*" = anyone)
        out: dict[int, set[str]] = {}
        for rule in policy["spec"]["ingress"]:
            who = {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component", "other")
                   for p in rule["from"]} if "from" in rule else {"*"}
            for port in rule["ports"]:
                out.setdefault(port["port"], set()).update(who)
        return out
    # etcd: clients are the meta servers, peers the members; /metrics only for the kubelet's probe
    assert allowed(nps["hg-hourglass-etcd"]) == {2379: {"metaserver", "etcd"}, 2380: {"etcd"}}
    assert allowed(nps["hg-hourglass-servers"])[7102] == {"*"}  # metricsFrom [] = anyone, on the pod IP
    objs = render(helm, sets=["security.networkPolicy.etcdMetricsFrom[0].podSelector.matchLabels.app=prometheus"])
    metrics_rule = by_kind(objs, "NetworkPolicy")["hg-hourglass-etcd"]["spec"]["ingress"][-1]
    assert metrics_rule == {"from": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}],
                            "ports": [{"port": 2381, "protocol": "TCP"}]}


def _cert(pem: bytes):
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem)


def _issued_by(pem: bytes, ca_pem: bytes) -> bool:
    """The certificate's signature checks against the CA's key (not only its issuer's name)."""
    try:
        _cert(pem).verify_directly_issued_by(_cert(ca_pem))
        return True
    except Exception:
        return False


def test_etcd_trusts_a_ca_that_signs_no_client_or_node_certificate(helm):
    """Issue 27: etcd is the meta servers' alone. The CA etcd is given (ca.crt of its Secret, its
    --trusted-ca-file) signs the members and the meta servers' etcd-client certificate, and
    neither the client nor the node certificate; the client CA signs the client certificate
    only and etcd is not given it."""
    objs = render(helm)
    sec = _secrets(objs)
    ec = container(by_kind(objs, "StatefulSet")["hg-hourglass-etcd"])
    assert "--trusted-ca-file=/etc/etcd/tls/ca.crt" in ec["args"]
    etcd_vol = by_kind(objs, "StatefulSet")["hg-hourglass-etcd"]["spec"]["template"]["spec"]["volumes"]
    assert [v["secret"]["secretName"] for v in etcd_vol] == ["hg-hourglass-etcd-tls"]
    etcd_ca = sec["hg-hourglass-etcd-tls"]["ca.crt"]
    assert sec["hg-hourglass-etcd-client-tls"]["ca.crt"] == etcd_ca  # the meta servers check etcd with it
    for name in ("hg-hourglass-client-tls", "hg-hourglass-tls"):
        assert not _issued_by(sec[name]["tls.crt"], etcd_ca), name
    for name in ("hg-hourglass-etcd-tls", "hg-hourglass-etcd-client-tls"):  # control: the check can pass
        assert _issued_by(sec[name]["tls.crt"], etcd_ca), name
    client_ca, node_ca = sec["hg-hourglass-client-ca"]["ca.crt"], sec["hg-hourglass-tls"]["ca.crt"]
    assert len({etcd_ca, client_ca, node_ca}) == 3
    assert _issued_by(sec["hg-hourglass-client-tls"]["tls.crt"], client_ca)
    assert not _issued_by(sec["hg-hourglass-client-tls"]["tls.crt"], node_ca)
    assert not _issued_by(sec["hg-hourglass-tls"]["tls.crt"], client_ca)
    # the bootstrap client checks servers with the node CA
    assert sec["hg-hourglass-client-tls"]["ca.crt"] == node_ca
    assert _cert(sec["hg-hourglass-client-tls"]["tls.crt"]).subject.rfc4514_string() == "CN=client:admin"
    assert f"--peer-cert-allowed-cn=etcd-member:hg-hourglass" in ec["args"]
    assert _cert(sec["hg-hourglass-etcd-tls"]["tls.crt"]).subject.rfc4514_string() == "CN=etcd-member:hg-hourglass"


def test_existing_certificates_need_etcds_own(helm):
    # the console (on by default) needs its own client certificate with existing certificates:
    # tests/test_helm.py's console test covers that; here it is off
    base = ["security.certificates=existing", "security.existingSecrets.tls=my-tls", "console.enabled=false"]
    r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *sum((["--set", s] for s in base), []))
    assert r.returncode != 0 and "set security.existingSecrets.etcd" in r.stderr, r.stderr
    objs = render(helm, sets=base + ["security.existingSecrets.etcd=my-etcd", "security.existingSecrets.etcdClient=my-ec",
                                     "security.existingSecrets.clientCa=my-client-ca"])
    assert not by_kind(objs, "Secret").keys() - {"hg-hourglass-auth", "hg-hourglass-client-token"}
    ms = by_kind(objs, "Deployment")["hg-hourglass-metaserver"]["spec"]["template"]["spec"]
    vols = {v["name"]: v["secret"]["secretName"] for v in ms["volumes"] if "secret" in v}
    assert vols == {"tls": "my-tls", "auth": "hg-hourglass-auth", "client-ca": "my-client-ca", "etcd-client": "my-ec"}
    etcd = by_kind(objs, "StatefulSet")["hg-hourglass-etcd"]["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in etcd["volumes"]] == ["my-etcd"]
    # no client CA named: the servers trust the node CA alone, as before
    objs = render(helm, sets=base + ["security.existingSecrets.etcd=my-etcd", "security.existingSecrets.etcdClient=my-ec"])
    env = env_of(container(by_kind(objs, "StatefulSet")["hg-hourglass-delay-d1"]))
    assert "HOURGLASS_TLS_CLIENT_CA_FILE" not in env


def test_security_off_is_plaintext_and_says_so(helm):
    objs = render(helm, sets=["security.enabled=false"])
    assert not by_kind(objs, "Secret") and not by_kind(objs, "NetworkPolicy")
    c = container(by_kind(objs, "StatefulSet")["hg-hourglass-delay-d1"])
    assert not any(k.startswith("HOURGLASS_TLS_") for k in env_of(c))


def test_cert_manager_certificates_when_its_api_is_there(helm):
    r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", "1.37.0",
                 "--api-versions", "cert-manager.io/v1")
    assert r.returncode == 0, r.stderr
    objs = [d for d in yaml.safe_load_all(r.stdout) if d]
    certs = by_kind(objs, "Certificate")
    assert set(certs) == {"hg-hourglass-ca", "hg-hourglass-client-ca", "hg-hourglass-etcd-ca", "hg-hourglass-node",
                          "hg-hourglass-etcd", "hg-hourglass-etcd-client", "hg-hourglass-client",
                          "hg-hourglass-console-https"}
    assert certs["hg-hourglass-node"]["spec"]["commonName"] == "node:hg-hourglass"
    assert certs["hg-hourglass-node"]["spec"]["secretName"] == "hg-hourglass-tls"
    # three CAs: node certificates from the node CA, the client's from the client CA, etcd's from etcd's
    issuer = {n: c["spec"]["issuerRef"]["name"] for n, c in certs.items()}
    assert issuer == {"hg-hourglass-ca": "hg-hourglass-selfsigned", "hg-hourglass-client-ca": "hg-hourglass-selfsigned",
                      "hg-hourglass-etcd-ca": "hg-hourglass-selfsigned", "hg-hourglass-node": "hg-hourglass-ca",
                      "hg-hourglass-client": "hg-hourglass-client-ca", "hg-hourglass-etcd": "hg-hourglass-etcd-ca",
                      "hg-hourglass-etcd-client": "hg-hourglass-etcd-ca", "hg-hourglass-console-https": "hg-hourglass-ca"}
    assert set(by_kind(objs, "Issuer")) == {"hg-hourglass-selfsigned", "hg-hourglass-ca", "hg-hourglass-client-ca",
                                            "hg-hourglass-etcd-ca"}
    assert set(by_kind(objs, "Secret")) == {"hg-hourglass-auth", "hg-hourglass-client-token"}  # certs: cert-manager's
    ms = by_kind(objs, "Deployment")["hg-hourglass-metaserver"]["spec"]["template"]["spec"]
    vols = {v["name"]: v["secret"]["secretName"] for v in ms["volumes"] if "secret" in v}
    assert vols["etcd-client"] == "hg-hourglass-etcd-client-tls"
    assert vols["client-ca"] == "hg-hourglass-client-tls"  # its ca.crt: the client CA (a CA issuer's)
    # a node issuer of the user's own does not become the client's or etcd's
    r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--api-versions", "cert-manager.io/v1",
                 "--set", "security.certManager.issuerRef.name=corp-ca", "--set", "security.certManager.issuerRef.kind=ClusterIssuer")
    assert r.returncode == 0, r.stderr
    certs = by_kind([d for d in yaml.safe_load_all(r.stdout) if d], "Certificate")
    assert {n: c["spec"]["issuerRef"]["name"] for n, c in certs.items() if not c["spec"].get("isCA")} == {
        "hg-hourglass-node": "corp-ca", "hg-hourglass-client": "hg-hourglass-client-ca",
        "hg-hourglass-etcd": "hg-hourglass-etcd-ca", "hg-hourglass-etcd-client": "hg-hourglass-etcd-ca",
        "hg-hourglass-console-https": "corp-ca"}  # the console serves HTTPS under the node issuer


@pytest.mark.skipif(not shutil.which("etcd"), reason="etcd binary not installed")
async def test_the_charts_certificates_and_token_work_with_the_real_processes(helm, tmp_path):
    """What the chart generates (sprig's RSA keys, the fixed server name, the admin token and
    its digest, three CAs) runs a real secure cluster: nodes and meta server with the chart's
    node certificate and client CA, etcd with its member certificate, the meta server with its
    etcd-client certificate, a client with the chart's client Secret; the client and node
    certificates are refused by that etcd."""
    from cluster.devcluster import LocalCluster
    from cluster.discovery import MetaResolver
    from tests.helpers.flow import round_trip

    sec = _secrets(render(helm))
    c = LocalCluster(tmp_path / "c", meta=True, secure=True,
                     env={"HOURGLASS_TLS_SERVER_NAME": "hg-hourglass.brokers.hourglass"})
    d = c.security
    files = {d.ca: sec["hg-hourglass-tls"]["ca.crt"], d.node_cert: sec["hg-hourglass-tls"]["tls.crt"],
             d.node_key: sec["hg-hourglass-tls"]["tls.key"], d.client_cert: sec["hg-hourglass-client-tls"]["tls.crt"],
             d.client_key: sec["hg-hourglass-client-tls"]["tls.key"], d.auth_file: sec["hg-hourglass-auth"]["auth.json"],
             d.admin_token_file: sec["hg-hourglass-client-token"]["token"],
             d.client_ca: sec["hg-hourglass-client-ca"]["ca.crt"], d.etcd_ca: sec["hg-hourglass-etcd-tls"]["ca.crt"],
             d.etcd_member_cert: sec["hg-hourglass-etcd-tls"]["tls.crt"],
             d.etcd_member_key: sec["hg-hourglass-etcd-tls"]["tls.key"],
             d.etcd_client_cert: sec["hg-hourglass-etcd-client-tls"]["tls.crt"],
             d.etcd_client_key: sec["hg-hourglass-etcd-client-tls"]["tls.key"]}
    for path, data in files.items():
        path.write_bytes(data)
    with c:
        c.wait_registered()
        r = MetaResolver(c.meta_addresses, security=c.client_security(tls_server_name="hg-hourglass.brokers.hourglass"))
        try:
            assert "chart-1" in await round_trip(r, "chart.x", "chart-1")
        finally:
            await r.close()
        import grpc
        from aetcd import rpc as etcdrpc

        async def etcd_range(cert: bytes, key: bytes) -> int:
            creds = grpc.ssl_channel_credentials(root_certificates=sec["hg-hourglass-etcd-tls"]["ca.crt"],
                                                 private_key=key, certificate_chain=cert)
            async with grpc.aio.secure_channel(c.etcd_endpoints[0], creds, options=[
                    ("grpc.ssl_target_name_override", "localhost")]) as ch:
                reply = await etcdrpc.KVStub(ch).Range(etcdrpc.RangeRequest(key=b"/hourglass/", range_end=b"/hourglass0"),
                                                       timeout=5)
                return len(reply.kvs)
        assert await etcd_range(sec["hg-hourglass-etcd-client-tls"]["tls.crt"], sec["hg-hourglass-etcd-client-tls"]["tls.key"])
        for name in ("hg-hourglass-client-tls", "hg-hourglass-tls"):
            with pytest.raises(grpc.RpcError) as err:
                await etcd_range(sec[name]["tls.crt"], sec[name]["tls.key"])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
