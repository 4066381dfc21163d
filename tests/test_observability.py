"""The Grafana dashboard and the Prometheus alert rules the chart ships (issue 31).

* The dashboard JSON (``helm/hourglass/dashboards/hourglass.json``) is checked against a JSON
  schema of the Grafana dashboard model (the fields Grafana needs to load it: uid, title,
  schemaVersion, panels with a known type, a grid position inside the 24-column grid, queries
  with a refId and an expression) and every metric a query names is one the node or meta
  server processes export: the list is derived from the code (``NodeMetrics``,
  ``MetaMetrics``), not written here.
* The alert rules are rendered by a real helm from the chart (``metrics.prometheusRule``) and
  checked with ``promtool check rules`` (built from the Go module proxy by
  ``scripts/promtool.sh``, cached), and against a schema of Prometheus's rule-file format;
  every ``hourglass_*`` metric they name is exported, and the one foreign metric
  (kube-state-metrics') is named on purpose.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helpers.tools import helm_binary, promtool_binary

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "hourglass"
DASHBOARD = CHART / "dashboards" / "hourglass.json"
FOREIGN_METRICS = {"kube_statefulset_status_update_revision"}  # kube-state-metrics: "without a deploy"

PANEL_TYPES = {"row", "timeseries", "stat", "bargauge", "gauge", "table", "text", "heatmap", "barchart"}
DURATION = r"^[0-9]+(ms|s|m|h|d|w|y)$"

DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "refresh": {"type": "string"},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array", "items": {
            "type": "object", "required": ["name", "type"],
            "properties": {"type": {"enum": ["datasource", "query", "custom", "constant", "interval", "textbox"]}}}}}},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["id", "type", "title", "gridPos"],
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "type": {"enum": sorted(PANEL_TYPES)},
                "title": {"type": "string", "minLength": 1},
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"], "additionalProperties": False,
                            "properties": {"h": {"type": "integer", "minimum": 1},
                                           "w": {"type": "integer", "minimum": 1, "maximum": 24},
                                           "x": {"type": "integer", "minimum": 0, "maximum": 23},
                                           "y": {"type": "integer", "minimum": 0}}},
                "targets": {"type": "array", "items": {
                    "type": "object", "required": ["refId", "expr"],
                    "properties": {"refId": {"type": "string", "minLength": 1},
                                   "expr": {"type": "string", "minLength": 1}}}},
            }}},
    },
}

RULES_SCHEMA = {
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "interval": {"type": "string", "pattern": DURATION},
            "rules": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["alert", "expr", "labels", "annotations"], "additionalProperties": False,
                "properties": {
                    "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                    "expr": {"type": "string", "minLength": 1},
                    "for": {"type": "string", "pattern": DURATION},
                    "labels": {"type": "object", "required": ["severity"],
                               "properties": {"severity": {"enum": ["info", "warning", "critical"]}}},
                    "annotations": {"type": "object", "required": ["summary", "description"]},
                }}},
        }}}},
}


def exported_metrics() -> set[str]:
    """Every sample name the node and meta server processes expose (``_total``, ``_bucket``...)."""
    from metaserver.metrics import MetaMetrics
    from node.metrics import NodeMetrics

    names: set[str] = set()
    for registry in (NodeMetrics("delay", "n1").registry, MetaMetrics(lambda: True).registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "histogram":
                names.update(family.name + sfx for sfx in ("_bucket", "_count", "_sum"))
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def metrics_named(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers followed by a selector or a range,
    and every ``hourglass_`` identifier anywhere (label names and functions are neither)."""
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr))
    names |= set(re.findall(r"\b(hourglass_[a-zA-Z0-9_]+)", expr))
    keywords = {"by", "without", "on", "ignoring", "group_left", "group_right", "rate", "increase", "sum", "max",
                "min", "deriv", "changes", "histogram_quantile", "avg", "count"}
    return names - keywords


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_exported_metrics_are_derived_from_the_code():
    names = exported_metrics()
    assert "hourglass_ingested_messages_total" in names
    assert "hourglass_delivery_lateness_seconds_bucket" in names
    assert "hourglass_meta_etcd_healthy" in names
    assert "hourglass_no_such_metric" not in names


def test_dashboard_matches_the_grafana_model():
    d = dashboard()
    jsonschema.validate(d, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
        if p["type"] != "row":
            assert refs, f"panel {p['title']!r} has no query"


def test_dashboard_schema_rejects_a_broken_dashboard():
    """Negative control: the schema check above can fail."""
    d = dashboard()
    d["panels"][1]["gridPos"]["w"] = 30
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, DASHBOARD_SCHEMA)
    d = dashboard()
    del d["panels"][1]["targets"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, DASHBOARD_SCHEMA)


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_metrics()
    queries = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 15
    for q in queries:
        named = metrics_named(q)
        assert named, f"no metric in {q!r}"
        assert named <= exported, f"{q!r} names {sorted(named - exported)}, which no process exports"
    # the namespace variable's query too
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.search(r"label_values\((\w+)", v["definition"])
            assert m and m.group(1) in exported, v["definition"]


def test_metric_names_are_found_in_promql():
    assert metrics_named('sum by (le) (rate(hourglass_x_bucket{a="b"}[5m]))') == {"hourglass_x_bucket"}
    assert metrics_named("a_b / c_d{x='1'} unless on (ns) kube_y[5m]") == {"c_d", "kube_y"}


# ------------------------------------------------------------------ alert rules (rendered by helm)


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


def render(helm: str, *sets: str) -> list[dict]:
    args = [helm, "template", "hg", str(CHART), "--namespace", "brokers"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rules(helm) -> dict:
    objs = render(helm, "metrics.prometheusRule.enabled=true", "metrics.alerts.latenessP99Seconds=0.5")
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    return rule["spec"]


@pytest.mark.integration
def test_alert_rules_cover_what_operators_page_on(rules):
    jsonschema.validate(rules, RULES_SCHEMA)
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {"HourglassMasterChangedWithoutDeploy", "HourglassLatenessHigh", "HourglassConsumerLagGrowing",
            "HourglassDiskWatermarkNear", "HourglassCorruptionFound"} <= set(by_name)
    assert "> 0.5" in by_name["HourglassLatenessHigh"]["expr"]  # the value set at install reaches the rule
    exported = exported_metrics()
    for r in by_name.values():
        named = metrics_named(r["expr"])
        assert named - FOREIGN_METRICS <= exported, f"{r['alert']} names {sorted(named - exported)}"
        assert 'namespace="brokers"' in r["expr"], r["alert"]


@pytest.mark.integration
def test_alert_rules_pass_promtool(rules, tmp_path):
    promtool = promtool_binary()
    good = tmp_path / "rules.yaml"
    good.write_text(yaml.safe_dump(rules))
    ok = subprocess.run([promtool, "check", "rules", str(good)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.search(r"SUCCESS: (\d+) rules found", ok.stdout + ok.stderr)
    # negative control: a broken expression is refused
    bad_rules = json.loads(json.dumps(rules))
    bad_rules["groups"][0]["rules"][0]["expr"] = "sum by (namespace (hourglass_master_changes_total"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(bad_rules))
    no = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True, timeout=120)
    assert no.returncode != 0


@pytest.mark.integration
def test_dashboard_configmap_carries_the_sidecar_label_and_the_json(helm):
    objs = render(helm, "metrics.grafanaDashboard.enabled=true")
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["hourglass.json"]) == dashboard()
    assert not [o for o in render(helm) if o["kind"] in ("PrometheusRule",) or
                o["metadata"]["name"].endswith("-dashboard")], "both are off unless asked for"
