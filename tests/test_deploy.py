"""Deployment files stay consistent with the service: parseable, and every metric they query exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def exported_metric_names() -> set[str]:
    """Names the engine registers (kvpop/serving/metrics.py), with Prometheus' histogram series."""
    source = (ROOT / "kvpop" / "serving" / "metrics.py").read_text()
    names = set()
    for kind, name in re.findall(r'(gauge|counter|histogram)\("(kvpop_\w+)"', source):
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def test_deploy_yaml_parses():
    for path in DEPLOY.rglob("*.y*ml"):
        assert list(yaml.safe_load_all(path.read_text())), path


def test_dashboard_and_alerts_query_only_exported_metrics():
    exported = exported_metric_names()
    assert "kvpop_kv_bytes_capacity" in exported and "kvpop_batch_size_count" in exported
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana" / "dashboards" / "kvpop.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [rule["expr"] for group in yaml.safe_load((DEPLOY / "monitoring" / "alerts.yml").read_text())["groups"]
                for rule in group["rules"]]
    used = {name for query in queries for name in re.findall(r"\bkvpop_\w+", re.sub(r"\"[^\"]*\"", "", query))}
    assert used and used <= exported, used - exported


def test_kubernetes_pod_takes_two_gpus_and_probes_readiness():
    deployment = next(doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "deployment.yaml").read_text())
                      if doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # config.pbtxt: one instance on each of GPUs 0, 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
