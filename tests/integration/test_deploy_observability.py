"""deploy/ observability checked offline (issue 25): the compose `observability` profile by the real Compose v2
binary, the Prometheus scrape config, the Grafana dashboard against the metric names the services export, and
the k8s metrics ports and ServiceMonitor."""

import json
import re
from pathlib import Path

import yaml

from tests.integration.test_deploy import COMPOSE, DEPLOY, K8S, MESHRL_ROLES, compose, compose_model, render_k8s

REPO = DEPLOY.parent
DASHBOARD = DEPLOY / "grafana" / "meshrl.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
# Where metric names are defined: the services' and the coordinator's observability modules.
SOURCES = [REPO / "services" / "common" / "rpc" / "metrics.py", REPO / "coordinator" / "runapi" / "observe.py"]


def exported_names() -> set[str]:
    """Every meshrl_ sample name the code can export: counters get _total, histograms _bucket/_sum/_count."""
    names = set()
    for path in SOURCES:
        text = path.read_text()
        for kind, name in re.findall(r"\b(Counter|Histogram|Gauge|GaugeMetricFamily|CounterMetricFamily)\(\s*\"(meshrl_\w+)\"",
                                     text):
            if kind.startswith("Counter"):
                names.add(name + "_total")
            elif kind == "Histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            else:
                names.add(name)
    return names


def observability_model() -> dict:
    result = compose(COMPOSE, args=("--profile", "observability", "config", "--format", "json"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_v2_accepts_the_observability_profile_and_leaves_it_out_by_default():
    result = compose(COMPOSE, args=("--profile", "observability", "config", "-q"))
    assert result.returncode == 0, result.stderr
    services = observability_model()["services"]
    assert {"prometheus", "grafana"} <= set(services)
    assert not {"prometheus", "grafana"} & set(compose_model(COMPOSE)["services"])


def test_every_meshrl_service_serves_metrics_on_the_port_prometheus_scrapes_by_role():
    services = observability_model()["services"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    [sd] = config["scrape_configs"][0]["dns_sd_configs"]
    for role in MESHRL_ROLES:
        assert services[role]["environment"]["MESHRL_SERVER__METRICS_PORT"] == str(sd["port"]), role
        assert role in sd["names"], role
    mounts = {m["target"]: m for m in services["prometheus"]["volumes"] if m["type"] == "bind"}
    assert Path(mounts["/etc/prometheus/prometheus.yml"]["source"]) == PROMETHEUS
    grafana = {m["target"]: Path(m["source"]) for m in services["grafana"]["volumes"]}
    assert grafana["/var/lib/grafana/dashboards/meshrl.json"] == DASHBOARD
    provisioning = grafana["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "meshrl.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_dashboard_queries_only_metrics_the_services_export_and_covers_the_issue_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    uid = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
                         )["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    used = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bmeshrl_\w+", target["expr"]))
            assert names <= exported, (panel["title"], names - exported)
            used |= names
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Step time by phase", "Rollout tokens/s per replica", "Replica health",
            "Weight version lag per replica"} <= titles
    assert {"meshrl_coordinator_phase_seconds_sum", "meshrl_rollout_generated_tokens_total",
            "meshrl_coordinator_replicas", "meshrl_rollout_weight_version", "meshrl_trainer_weight_version"} <= used


def test_the_dashboard_has_a_run_variable_and_every_coordinator_panel_shows_only_the_picked_runs():
    """Issue 45: many runs on one mesh; the coordinator's metrics carry `run_id` and the dashboard filters by it."""
    dashboard = json.loads(DASHBOARD.read_text())
    [run] = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert run["type"] == "query" and run["query"] == "label_values(meshrl_coordinator_step, run_id)"
    assert run["includeAll"] and run["multi"] and run["allValue"] == ".*"
    source = (REPO / "coordinator" / "runapi" / "observe.py").read_text()
    coordinator = {n for n in exported_names() if n.startswith("meshrl_coordinator_")}
    # Every coordinator metric is labelled run_id where it is defined (labels=[...] or a Histogram's label list).
    for name in {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in coordinator}:
        defined = re.search(rf'"{name}",(?:(?!meshrl_)[^\[])*\[\s*"run_id"', source)    # its first label list
        assert defined, f"{name} carries no run_id label"
    filtered = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, selector in re.findall(r"\b(meshrl_coordinator_\w+)(\{[^}]*\})?", target["expr"]):
                assert 'run_id=~"$run"' in selector, (panel["title"], name, target["expr"])
                filtered.add(name)
    assert {"meshrl_coordinator_reward", "meshrl_coordinator_accuracy", "meshrl_coordinator_step",
            "meshrl_coordinator_phase_seconds_sum", "meshrl_coordinator_step_seconds_sum",
            "meshrl_coordinator_samples_total"} <= filtered
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Reward per run", "Accuracy per run", "Samples/s per run"} <= titles


def test_k8s_pods_serve_metrics_on_a_named_port_the_service_monitor_scrapes():
    objects = render_k8s()
    monitor = yaml.safe_load((K8S / "monitoring" / "servicemonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    [endpoint] = monitor["spec"]["endpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert selector.items() <= kust["labels"][0]["pairs"].items()       # kustomize puts it on every Service
    monitoring = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert monitoring["resources"] == ["servicemonitor.yaml"] and monitoring["namespace"] == kust["namespace"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")}
    for role in MESHRL_ROLES:
        port = next(p for p in services[role]["spec"]["ports"] if p["name"] == endpoint["port"])
        container_port = next(p["containerPort"] for p in pods[role]["ports"] if p["name"] == port["targetPort"])
        env = {e["name"]: e.get("value") for e in pods[role]["env"]}
        assert env["MESHRL_SERVER__METRICS_PORT"] == str(container_port), role
    # the trainer's other ranks run no server: only rank 0's pod serves metrics
    assert "MESHRL_SERVER__METRICS_PORT" not in {e["name"] for e in pods["trainer-worker"]["env"]}
