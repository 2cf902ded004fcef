"""Deployment files stay consistent with the service: parseable, and every metric they query exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.nodes import lb
from kvpop.serving.process.tritonserver import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def exported_metric_names() -> set[str]:
    """Names the engine registers (kvpop/serving/kvpop_engine/metrics.py), with Prometheus' histogram series."""
    source = (ROOT / "kvpop" / "serving" / "kvpop_engine" / "metrics.py").read_text()
    found = re.findall(r'(gauge|counter|histogram)\("(kvpop_\w+)"', source)
    found += [(kind.lower(), name) for name, kind in re.findall(r'family\("(kvpop_\w+)", "[^"]*", "(GAUGE|COUNTER|HISTOGRAM)"\)', source)]
    names = set()
    for kind, name in found:
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def dashboard_panels() -> list[dict]:
    """Every panel of the Grafana dashboard, rows' nested panels included (rows themselves query nothing)."""
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana" / "dashboards" / "kvpop.json").read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return panels


def metrics_in(query: str) -> set[str]:
    return set(re.findall(r"\bkvpop_\w+", re.sub(r"\"[^\"]*\"", "", query)))


def test_deploy_yaml_parses():
    for path in DEPLOY.rglob("*.y*ml"):
        assert list(yaml.safe_load_all(path.read_text())), path


def test_dashboard_and_alerts_query_only_exported_metrics():
    exported = exported_metric_names()
    assert "kvpop_kv_bytes_capacity" in exported and "kvpop_batch_size_count" in exported
    assert "kvpop_session_bytes" in exported  # registered through family(): a tier label per metric
    queries = [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]
    queries += [rule["expr"] for group in yaml.safe_load((DEPLOY / "monitoring" / "alerts.yml").read_text())["groups"]
                for rule in group["rules"]]
    used = {name for query in queries for name in metrics_in(query)}
    assert used and used <= exported, used - exported


def test_dashboard_shows_sessions_and_prefix_reuse():
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    row = next(panel for panel in panels if panel["type"] == "row" and panel["title"] == "Sessions and prefix reuse")
    below = [panel for panel in panels if panel["gridPos"]["y"] > row["gridPos"]["y"] and panel["type"] != "row"]
    used = {name for panel in below for target in panel["targets"] for name in metrics_in(target["expr"])}
    wanted = {
        "kvpop_session_hit_ratio", "kvpop_session_tokens_reused_total", "kvpop_session_prompt_tokens_total",
        "kvpop_session_hits_total", "kvpop_session_lookups_total",
        "kvpop_prefix_hit_ratio", "kvpop_prefix_hits_total", "kvpop_prefix_lookups_total", "kvpop_prefix_tokens_reused_total",
        "kvpop_session_bytes", "kvpop_session_entries", "kvpop_session_promotions_total", "kvpop_session_demotions_total",
        "kvpop_session_checkpoints_written_total", "kvpop_session_checkpoints_rejected_total",
        "kvpop_session_checkpoint_failures_total", "kvpop_session_restore_seconds_bucket", "kvpop_session_checkpoint_queue",
    }
    assert wanted <= used, wanted - used
    quantiles = [target["expr"] for panel in below for target in panel["targets"] if "histogram_quantile" in target["expr"]]
    assert {re.match(r"histogram_quantile\(([\d.]+),", expr).group(1) for expr in quantiles} == {"0.5", "0.95"}
    assert all("by (le)" in expr and "_bucket[" in expr for expr in quantiles)
    cells = set()  # no two panels overlap on the 24-column grid
    for panel in panels:
        box = panel["gridPos"]
        area = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert box["x"] + box["w"] <= 24 and not area & cells, panel["title"]
        cells |= area


KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest version the manifests target (autoscaling/v2, policy/v1)
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no schema offline; checked below


def kubernetes_documents() -> dict[str, dict]:
    """Every resource `kubectl apply -f deploy/kubernetes/` would create, by kind/name."""
    documents = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            documents[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return documents


def test_kubernetes_manifests_pass_the_schema_check():
    import kubernetes_validate

    checked = 0
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
                assert doc["spec"]["selector"]["matchLabels"] == {"app": "kvpop-serve"}
                continue
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises with the offending field
            checked += 1
    assert checked >= 7


def test_the_schema_check_catches_a_mistake():
    import kubernetes_validate

    hpa = kubernetes_documents()["HorizontalPodAutoscaler/kvpop-serve"]
    broken = json.loads(json.dumps(hpa))
    broken["spec"]["metrics"][0]["resource"]["target"]["averageUtilisation"] = 70  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kubernetes_pod_takes_two_gpus_and_probes_the_launcher_health_port():
    documents = kubernetes_documents()
    pod = documents["Deployment/kvpop-serve"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # config.pbtxt: one instance on each of GPUs 0, 1
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "health": 8003}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "health"}
    # The pod is given the drain time plus the preStop pause and a margin before it is killed.
    env = {item["name"]: item for item in container["env"]}
    grace = int(env["KVPOP_GRACE_SECONDS"]["value"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= grace + pre_stop + 5
    assert env["KVPOP_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kvpop-admin"


def test_kubernetes_pod_runs_the_openai_api_beside_triton_and_routes_v1_to_it():
    documents = kubernetes_documents()
    triton, api = documents["Deployment/kvpop-serve"]["spec"]["template"]["spec"]["containers"]
    assert triton["args"][-2:] == ["--openai-port", "0"]  # not also inside the Triton container
    assert api["command"][:3] == ["python3", "-m", "kvpop.openai_api"]
    assert api["command"][api["command"].index("--triton-grpc") + 1] == "127.0.0.1:8001"
    assert {port["name"]: port["containerPort"] for port in api["ports"]} == {"openai": 9000}
    assert api["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    service_ports = {port["name"]: port["targetPort"] for port in documents["Service/kvpop-serve"]["spec"]["ports"]}
    assert service_ports["openai"] == "openai"
    http = documents["Ingress/kvpop-serve-http"]["spec"]["rules"][0]["http"]["paths"]
    assert {path["path"]: path["backend"]["service"]["port"]["name"] for path in http} == {"/v2": "http", "/v1": "openai"}


def test_autoscaler_budget_and_routing_point_at_the_deployment():
    documents = kubernetes_documents()
    hpa = documents["HorizontalPodAutoscaler/kvpop-serve"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    assert hpa["scaleTargetRef"]["name"] == "kvpop-serve"
    cpu = next(metric for metric in hpa["metrics"] if metric["type"] == "Resource")
    assert cpu["resource"]["target"]["averageUtilization"] == 70
    # Every custom metric the HPA asks for is one the Prometheus adapter serves, built from exported series.
    adapter = yaml.safe_load(documents["ConfigMap/prometheus-adapter"]["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"]}
    wanted = {metric["pods"]["metric"]["name"] for metric in hpa["metrics"] if metric["type"] == "Pods"}
    assert wanted and wanted <= served, wanted - served
    queried = {name for rule in adapter["rules"] for name in re.findall(r"\bkvpop_\w+", rule["seriesQuery"] + rule["metricsQuery"])}
    assert queried <= exported_metric_names(), queried - exported_metric_names()
    assert documents["PodDisruptionBudget/kvpop-serve"]["spec"]["selector"]["matchLabels"] == {"app": "kvpop-serve"}
    # Sessions: every Ingress hashes on the key that the controller's map derives from x-session-id.
    patch = yaml.safe_load((KUBERNETES / "ingress-nginx" / "controller-configmap-patch.yaml").read_text())
    assert "map $http_x_session_id $kvpop_session_key" in patch["data"]["http-snippet"]
    ingresses = [doc for key, doc in documents.items() if key.startswith("Ingress/")]
    assert len(ingresses) == 2
    for ingress in ingresses:
        assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$kvpop_session_key"


def test_compose_files_parse_and_expose_the_health_port():
    files = sorted(DEPLOY.rglob("*compose*.y*ml"))
    assert files
    for path in files:
        services = yaml.safe_load(path.read_text())["services"]
        assert all("image" in service or "build" in service for service in services.values()), path
    kvpop = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]["kvpop"]
    assert "8003:8003" in kvpop["ports"]


def test_every_deployment_keeps_session_state_on_a_volume_outside_the_model_repository():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    state = re.search(r"^ENV KVPOP_STATE_DIR=(\S+)$", dockerfile, re.M).group(1)
    assert not state.startswith("/models")
    pod = kubernetes_documents()["Deployment/kvpop-serve"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {item["name"]: item.get("value") for item in container["env"]}["KVPOP_STATE_DIR"] == state
    [mount] = [mount for mount in container["volumeMounts"] if mount["mountPath"] == state]
    assert mount["name"] in {volume["name"] for volume in pod["volumes"]}
    kvpop = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]["kvpop"]
    assert any(volume.endswith(f":{state}") for volume in kvpop["volumes"])
    assert f':{state}"' in (DEPLOY / "nodes" / "run-node.sh").read_text()


def test_images_are_pinned():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3" in dockerfile
    assert '"--health-port=8003"' in dockerfile
    assert re.search(r"^FROM nginx:\d+\.\d+\.\d+", (DEPLOY / "nodes" / "Dockerfile.lb").read_text(), re.M)


def rendered_nginx_config(tmp_path: Path) -> Path:
    out = tmp_path / "nginx.conf"
    lb.main(["render", "--nodes", str(DEPLOY / "nodes" / "nodes.example.txt"), "--out", str(out),
             "--run-dir", str(tmp_path), "--http-listen", "127.0.0.1:18080", "--grpc-listen", "127.0.0.1:18081",
             "--access-log", str(tmp_path / "access.log"), "--error-log", str(tmp_path / "error.log")])
    return out


def test_nginx_config_renders_every_node_with_its_weight(tmp_path):
    text = rendered_nginx_config(tmp_path).read_text()
    nodes = lb.read_nodes(DEPLOY / "nodes" / "nodes.example.txt")
    for node in nodes:
        assert f"server {node.http} weight={node.weight} " in text and f"server {node.grpc} weight={node.weight} " in text
        openai_address = node.http.rsplit(":", 1)[0] + ":9000"  # each node's OpenAI-compatible API
        assert f"server {openai_address} weight={node.weight} " in text
    assert text.count("hash $http_x_session_id consistent;") == 3  # HTTP, OpenAI and gRPC upstreams
    assert "location /v1/ {" in text and "proxy_pass http://kvpop_openai;" in text
    assert "@" not in re.sub(r"#.*", "", text)  # no placeholder left
    down = lb.render(nodes, lb.RenderOptions(), frozenset({"worker1"}))
    assert down.count(" down;  # worker1") == 3


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (make system-deps)")
def test_nginx_accepts_the_rendered_config(tmp_path):
    config = rendered_nginx_config(tmp_path)
    result = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


class DyingNode:
    """A node that dies while answering: it reads a whole request, then resets the connection (what a
    tritonserver killed with SIGKILL does to a request nginx had just sent it)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket
        import struct

        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection:
                data = b""
                while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < self._length(data):
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests += 1
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST

    @staticmethod
    def _length(data: bytes) -> int:
        found = re.search(rb"content-length: *(\d+)", data.split(b"\r\n\r\n", 1)[0], re.I)
        return int(found.group(1)) if found else 0


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (make system-deps)")
def test_nginx_sends_a_request_whose_node_died_with_it_to_another_node(tmp_path):
    """A POST nginx had already sent to a node that then died is retried on another node, not a 502."""
    import http.server
    import threading
    import time
    import urllib.request

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"outputs": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    dying, healthy = DyingNode(), http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"dying 127.0.0.1:{dying.port} 127.0.0.1:1 http://127.0.0.1:1/ready 1\n"
                     f"healthy 127.0.0.1:{healthy.server_port} 127.0.0.1:2 http://127.0.0.1:2/ready 1\n")
    listen = f"127.0.0.1:{free_port()}"
    lb.main(["render", "--nodes", str(nodes), "--out", str(tmp_path / "nginx.conf"), "--run-dir", str(tmp_path),
             "--http-listen", listen, "--grpc-listen", f"127.0.0.1:{free_port()}", "--worker-processes", "1",
             "--access-log", str(tmp_path / "access.log"), "--error-log", str(tmp_path / "error.log")])
    nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"])
    try:
        statuses = []
        for attempt in range(50):
            try:
                request = urllib.request.Request(f"http://{listen}/v2/models/kvpop_service/infer", b'{"inputs": []}',
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as response:
                    statuses.append(response.status)
            except urllib.error.HTTPError as error:
                statuses.append(error.code)
            except OSError:  # nginx not listening yet
                time.sleep(0.1)
            if dying.requests and len(statuses) >= 4:
                break
        assert dying.requests >= 1  # the dying node got (and dropped) a request
        assert statuses and set(statuses) == {200}, (statuses, (tmp_path / "error.log").read_text()[-2000:])
    finally:
        nginx.terminate()
        nginx.wait(10)
        healthy.shutdown()
        dying.listener.close()


def test_health_watcher_takes_a_failing_node_out_and_brings_it_back(tmp_path, monkeypatch):
    nodes = lb.read_nodes(DEPLOY / "nodes" / "nodes.example.txt")
    answers = {node.ready: True for node in nodes}
    monkeypatch.setattr(lb, "probe", lambda url, timeout_s: answers[url])
    reloads = []
    watcher = lb.HealthWatcher(nodes, tmp_path / "nginx.conf", lb.RenderOptions(), ["reload"], fall=2, rise=2)
    monkeypatch.setattr(lb.subprocess, "run", lambda command, check: reloads.append(command))
    watcher.check_once()
    answers[nodes[1].ready] = False
    assert not watcher.check_once() and watcher.down() == frozenset()  # one failed probe is not enough
    assert watcher.check_once() and watcher.down() == {nodes[1].name}
    assert f"server {nodes[1].http} weight={nodes[1].weight} max_fails=1 fail_timeout=10s down;" in (tmp_path / "nginx.conf").read_text()
    answers[nodes[1].ready] = True
    watcher.check_once()
    assert watcher.check_once() and watcher.down() == frozenset()
    assert len(reloads) == 3  # first render, out, back in
    for node in nodes:  # every node failing: leave them all in for the passive checks
        answers[node.ready] = False
    watcher.check_once(), watcher.check_once()
    assert watcher.down() == frozenset()


def test_node_scripts_are_valid_shell():
    for script in (DEPLOY / "nodes").glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
