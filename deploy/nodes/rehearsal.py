"""Rehearse the node deployment on one machine: real tritonservers behind a real nginx, no Docker.

    python -m deploy.nodes.rehearsal --out build/results/cluster/rehearsal.json    (what `make test-cluster` checks)

Three replicas of the repository's models (a freshly exported tiny Llama, CPU config) listen on
loopback ports; nginx runs the production config rendered from deploy/nodes/nginx.conf.template by
deploy/nodes/lb.py, and `lb.py watch` health-checks the replicas. Then, through nginx:

1. spread: requests without a session header split by the replicas' weights (counted per replica
   from nginx's access log and from each replica's `nv_inference_request_success`);
2. sessions: every request carrying an `x-session-id` lands on the same replica (HTTP and gRPC);
3. failover: under closed-loop load one replica's tritonserver is killed with SIGKILL; no request
   fails (nginx sends those that were in flight on it, or reached it as it died, to another replica),
   the watcher takes it out, it is restarted on the same ports and the watcher brings it back, after
   which it serves again.

Prints and saves every figure; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from deploy.nodes import lb
from export.repository import assemble_model_repository
from kvpop.serving.process.tritonserver import TritonServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
INFER_PATH = "/v2/models/kvpop_service/infer"


@dataclass
class Replica:
    name: str
    weight: int
    server: TritonServer
    load_seconds: list[float] = field(default_factory=list)  # process start -> /v2/health/ready, per start

    @property
    def upstream(self) -> str:
        return f"127.0.0.1:{self.server.http_port}"

    def ready_url(self) -> str:
        # Production nodes are probed on the launcher's health port (`GET :8003/ready`: Triton ready,
        # every Python stub alive, not draining). The rehearsal starts bare tritonservers, so it
        # probes Triton's own readiness on the HTTP port.
        return f"http://{self.server.http_url}/v2/health/ready"

    def start(self) -> None:
        started = time.monotonic()
        self.server.start()
        self.server.wait_ready(timeout=180)
        self.load_seconds.append(round(time.monotonic() - started, 2))

    def kill(self) -> float:
        """SIGKILL the tritonserver process; -> when it was gone (its sockets closed). Its stubs are
        killed by the restart (TritonServer.start), or exit on their own."""
        self.server.process.kill()
        self.server.process.wait()
        return time.time()

    def successes(self) -> int:
        text = urllib.request.urlopen(self.server.metrics_url, timeout=5).read().decode()
        return int(sum(float(value) for value in re.findall(
            r'^nv_inference_request_success\{model="kvpop_service",version="1"\} (\S+)$', text, re.M)))


def export_tiny_model(workdir: Path) -> Path:
    from export.pipeline import export_model
    from export.tiny_model import build_tiny_llama

    hf = build_tiny_llama(workdir / "hf")
    export_model(hf, workdir / "onnx")
    return workdir / "onnx"


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    session: str = ""


def post_infer(base_url: str, session: str = "", max_tokens: int = 4) -> Outcome:
    body = json.dumps({"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Let a = 7. What is a?"]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [max_tokens]},
    ]}).encode()
    headers = {"Content-Type": "application/json"}
    if session:
        headers["x-session-id"] = session
    started = time.time()
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url + INFER_PATH, body, headers), timeout=60) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError:
        status = 0
    return Outcome(started, time.time(), status, session)


@dataclass
class LogLine:
    ended: float
    status: int
    seconds: float
    upstreams: list[str]  # every node nginx tried, in order
    session: str
    upstream_statuses: str = ""

    @property
    def started(self) -> float:
        return self.ended - self.seconds


def read_access_log(path: Path) -> list[LogLine]:
    lines = []
    pattern = re.compile(r'^(\S+) (\d+) (\S+) "([^"]*)" "([^"]*)" "([^"]*)" POST ' + re.escape(INFER_PATH))
    for line in path.read_text().splitlines():
        match = pattern.match(line)
        if match:
            ended, status, seconds, upstreams, upstream_statuses, session = match.groups()
            addresses = [address.strip() for address in re.split(r"[,:]\s", upstreams + " ") if address.strip()]
            lines.append(LogLine(float(ended), int(status), float(seconds), addresses, "" if session == "-" else session,
                                 upstream_statuses))
    return lines


class Cluster:
    def __init__(self, workdir: Path, exported: Path, weights: list[int], interval_s: float):
        self.workdir = workdir
        repository = assemble_model_repository(workdir / "model_repository", exported)
        self.replicas = [
            Replica(f"replica{index}", weight, TritonServer(
                repository, free_port(), free_port(), free_port(), "127.0.0.1", "cpu",
                workdir / f"replica{index}.log", ["--exit-timeout-secs=2"],
                state_dir=workdir / f"replica{index}-state"))  # each node its own, as each has its volume
            for index, weight in enumerate(weights)
        ]
        self.http_port, self.grpc_port = free_port(), free_port()
        self.interval_s = interval_s
        self.run_dir = workdir / "lb"
        self.access_log = self.run_dir / "access.log"
        self.config = self.run_dir / "nginx.conf"
        self.nginx: subprocess.Popen | None = None
        self.watcher: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def by_upstream(self) -> dict[str, Replica]:
        return {replica.upstream: replica for replica in self.replicas}

    def lb_arguments(self) -> list[str]:
        nodes = self.run_dir / "nodes.txt"
        nodes.write_text("".join(
            f"{r.name} {r.upstream} 127.0.0.1:{r.server.grpc_port} {r.ready_url()} {r.weight}\n" for r in self.replicas))
        return ["--nodes", str(nodes), "--out", str(self.config),
                "--http-listen", f"127.0.0.1:{self.http_port}", "--grpc-listen", f"127.0.0.1:{self.grpc_port}",
                "--run-dir", str(self.run_dir), "--access-log", str(self.access_log),
                "--error-log", str(self.run_dir / "error.log"), "--worker-processes", "2"]

    def start(self) -> None:
        threads = [threading.Thread(target=replica.start) for replica in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        not_ready = [replica.name for replica in self.replicas if not replica.load_seconds]
        if not_ready:
            raise RuntimeError(f"replicas did not start: {not_ready}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        arguments = self.lb_arguments()
        lb.main(["render", *arguments])
        nginx = ["nginx", "-p", str(self.run_dir), "-c", str(self.config)]
        subprocess.run([*nginx, "-t", "-q"], check=True)
        self.nginx = subprocess.Popen([*nginx, "-g", "daemon off;"])
        self.watcher = subprocess.Popen(
            [sys.executable, str(Path(lb.__file__)), "watch", *arguments, "--interval", str(self.interval_s),
             "--fall", "2", "--rise", "2", "--probe-timeout", "1",
             "--reload-command", " ".join([*nginx, "-s", "reload"]),
             "--state-file", str(self.run_dir / "health.json")],
            stdout=open(self.run_dir / "watch.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.base_url + "/lb/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("nginx did not start")

    def health(self) -> dict:
        try:
            return json.loads((self.run_dir / "health.json").read_text())
        except (OSError, ValueError):
            return {"down": [], "events": []}

    def wait_for(self, predicate, timeout_s: float) -> float | None:
        started = time.time()
        while time.time() - started < timeout_s:
            if predicate():
                return time.time()
            time.sleep(0.1)
        return None

    def stop(self) -> None:
        for process in (self.watcher, self.nginx):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM if process is self.watcher else signal.SIGQUIT)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        for replica in self.replicas:
            replica.server.stop(timeout=15)


def phase_spread(cluster: Cluster, requests: int, concurrency: int) -> dict:
    before = {replica.name: replica.successes() for replica in cluster.replicas}
    log_start = len(read_access_log(cluster.access_log))
    outcomes = run_load(cluster.base_url, concurrency, count=requests)
    time.sleep(0.5)
    lines = read_access_log(cluster.access_log)[log_start:]
    routed = Counter(line.upstreams[-1] for line in lines if line.status == 200)
    total_weight = sum(replica.weight for replica in cluster.replicas)
    per_replica = {}
    for replica in cluster.replicas:
        per_replica[replica.name] = {
            "weight": replica.weight,
            "expected_share": round(replica.weight / total_weight, 3),
            "nginx_access_log": routed.get(replica.upstream, 0),
            "triton_nv_inference_request_success": replica.successes() - before[replica.name],
        }
    failed = sum(outcome.status != 200 for outcome in outcomes)
    return {"requests": requests, "concurrency": concurrency, "failed": failed, "per_replica": per_replica}


def phase_sessions(cluster: Cluster, sessions: int, per_session: int) -> dict:
    log_start = len(read_access_log(cluster.access_log))
    for round_number in range(per_session):
        for index in range(sessions):
            post_infer(cluster.base_url, session=f"session-{index}")
    time.sleep(0.5)
    placed = defaultdict(set)
    failed = 0
    for line in read_access_log(cluster.access_log)[log_start:]:
        if line.session:
            placed[line.session].add(line.upstreams[-1])
            failed += line.status != 200
    names = cluster.by_upstream()
    return {
        "sessions": sessions,
        "requests_per_session": per_session,
        "failed": failed,
        "sessions_on_one_replica": sum(len(upstreams) == 1 for upstreams in placed.values()),
        "sessions_per_replica": dict(Counter(names[next(iter(u))].name for u in placed.values() if len(u) == 1)),
        "grpc": phase_grpc_sessions(cluster, sessions=4, per_session=3),
    }


def phase_grpc_sessions(cluster: Cluster, sessions: int, per_session: int) -> dict:
    """gRPC through nginx's grpc_pass, the session id as metadata; the replica is read from the log."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Let a = 7. What is a?"]], dtype=object))
    tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    log_start = cluster.access_log.read_text().count("\n")
    ok = 0
    for _ in range(per_session):
        for index in range(sessions):
            result = client.infer("kvpop_service", [text, tokens], headers={"x-session-id": f"grpc-{index}"})
            ok += result.as_numpy("text_output") is not None
    client.close()
    time.sleep(0.5)
    placed = defaultdict(set)
    for line in cluster.access_log.read_text().splitlines()[log_start:]:
        match = re.match(r'^\S+ \d+ \S+ "([^"]*)" "[^"]*" "(grpc-\d+)" POST /inference.GRPCInferenceService/ModelInfer', line)
        if match:
            placed[match.group(2)].add(match.group(1).split(",")[-1].strip())
    return {"requests": sessions * per_session, "succeeded": ok,
            "sessions_on_one_replica": sum(len(u) == 1 for u in placed.values()), "sessions_seen": len(placed)}


def run_load(base_url: str, concurrency: int, count: int | None = None, stop: threading.Event | None = None,
             max_tokens: int = 4) -> list[Outcome]:
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    remaining = [count]

    def worker() -> None:
        while True:
            with lock:
                if count is not None:
                    if remaining[0] == 0:
                        return
                    remaining[0] -= 1
            if stop is not None and stop.is_set():
                return
            outcome = post_infer(base_url, max_tokens=max_tokens)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def phase_failover(cluster: Cluster, victim: Replica, concurrency: int, max_tokens: int) -> dict:
    log_start = len(read_access_log(cluster.access_log))
    stop = threading.Event()
    outcomes: list[Outcome] = []
    load = threading.Thread(target=lambda: outcomes.extend(run_load(cluster.base_url, concurrency, stop=stop,
                                                                    max_tokens=max_tokens)))
    load.start()
    time.sleep(4)
    killed_at = time.time()
    gone_at = victim.kill()
    taken_out_at = cluster.wait_for(lambda: victim.name in cluster.health()["down"], 30)
    time.sleep(2)  # traffic runs on the others alone for a while
    restart_at = time.time()
    victim.start()
    back_in_at = cluster.wait_for(lambda: victim.name not in cluster.health()["down"], 30)
    served_again = cluster.wait_for(lambda: victim.successes() >= 5, 30)
    time.sleep(1)
    stop.set()
    load.join()
    time.sleep(0.5)

    lines = read_access_log(cluster.access_log)[log_start:]
    # On the killed replica when it died: sent to it before it was gone, still unanswered at the kill.
    in_flight_on_victim = [line for line in lines if victim.upstream in line.upstreams
                           and line.started <= gone_at and line.ended >= killed_at]
    failed_lines = [line for line in lines if line.status != 200]
    rerouted = [line for line in lines if victim.upstream in line.upstreams[:-1] and line.status == 200]
    after_kill = Counter(cluster.by_upstream()[line.upstreams[-1]].name for line in lines
                         if line.started > killed_at and line.status == 200 and (back_in_at is None or line.ended < back_in_at))
    after_return = Counter(cluster.by_upstream()[line.upstreams[-1]].name for line in lines
                           if back_in_at is not None and line.started > back_in_at and line.status == 200)
    client_failed = [outcome for outcome in outcomes if outcome.status != 200]
    return {
        "killed": victim.name,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "requests": len(outcomes),
        "failed_at_client": len(client_failed),
        "failed_in_nginx_log": len(failed_lines),
        "in_flight_on_killed_replica": len(in_flight_on_victim),
        "in_flight_on_killed_replica_answered": sum(line.status == 200 for line in in_flight_on_victim),
        "seconds_kill_to_gone": round(gone_at - killed_at, 3),
        "failed_requests": [{"status": line.status, "upstreams": line.upstreams, "upstream_statuses": line.upstream_statuses,
                             "started_after_kill_s": round(line.started - killed_at, 3),
                             "ended_after_kill_s": round(line.ended - killed_at, 3)} for line in failed_lines],
        "retried_on_another_replica": len(rerouted),
        "seconds_kill_to_taken_out": round(taken_out_at - killed_at, 2) if taken_out_at else None,
        "seconds_restart_to_ready": victim.load_seconds[-1],
        "seconds_restart_to_back_in": round(back_in_at - restart_at, 2) if back_in_at else None,
        "served_after_return": bool(served_again),
        "served_while_out_per_replica": dict(after_kill),
        "served_after_return_per_replica": dict(after_return),
    }


def checks(report: dict) -> dict[str, bool]:
    spread = report["spread"]["per_replica"].values()
    total = sum(replica["nginx_access_log"] for replica in spread)
    failover = report["failover"]
    sessions = report["sessions"]
    return {
        "spread: no failed request": report["spread"]["failed"] == 0,
        "spread: each replica within 5 points of its weight's share": all(
            abs(replica["nginx_access_log"] / total - replica["expected_share"]) <= 0.05 for replica in spread),
        "spread: Triton's counters agree with nginx's log": all(
            replica["nginx_access_log"] == replica["triton_nv_inference_request_success"] for replica in spread),
        "sessions: every HTTP session stayed on one replica": sessions["sessions_on_one_replica"] == sessions["sessions"],
        "sessions: every gRPC session stayed on one replica": (
            sessions["grpc"]["sessions_on_one_replica"] == sessions["grpc"]["sessions_seen"] > 0
            and sessions["grpc"]["succeeded"] == sessions["grpc"]["requests"]),
        "failover: no failed request, those in flight on the killed replica retried on another": (
            failover["failed_at_client"] == failover["failed_in_nginx_log"] == 0
            and failover["in_flight_on_killed_replica_answered"] == failover["in_flight_on_killed_replica"]),
        "failover: the killed replica was taken out": failover["seconds_kill_to_taken_out"] is not None,
        "failover: the others served while it was out": len(failover["served_while_out_per_replica"]) == len(report["replicas"]) - 1,
        "failover: it came back in and served again": (
            failover["seconds_restart_to_back_in"] is not None and failover["served_after_return"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.nodes.rehearsal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "results" / "cluster" / "rehearsal.json")
    parser.add_argument("--exported-model", type=Path, help="an exported model dir (default: export a tiny Llama)")
    parser.add_argument("--weights", type=int, nargs="+", default=[2, 1, 1])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, nginx config)")
    args = parser.parse_args(argv)

    if shutil.which("nginx") is None:
        print("nginx not found: `make system-deps` installs it (Debian package nginx-light)", file=sys.stderr)
        return 2
    os.environ.setdefault("KVPOP_ORT_THREADS", "1")  # three servers share this machine's cores
    workdir = Path(tempfile.mkdtemp(prefix="kvpop-rehearsal-"))
    started = time.time()
    cluster = None
    try:
        exported = args.exported_model or export_tiny_model(workdir / "model")
        cluster = Cluster(workdir, exported, args.weights, args.health_interval)
        cluster.start()
        report = {
            "what": "3 tritonserver replicas on loopback behind nginx (deploy/nodes/nginx.conf.template) "
                    "and lb.py watch; no Docker",
            "nginx": subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip(),
            "replicas": {r.name: {"weight": r.weight, "upstream": r.upstream, "seconds_start_to_ready": r.load_seconds[0]}
                         for r in cluster.replicas},
            "health_interval_seconds": args.health_interval,
        }
        report["spread"] = phase_spread(cluster, args.requests, args.concurrency)
        report["sessions"] = phase_sessions(cluster, sessions=12, per_session=3)
        report["failover"] = phase_failover(cluster, cluster.replicas[1], args.concurrency, max_tokens=16)
        report["checks"] = checks(report)
        report["seconds"] = round(time.time() - started, 1)
    finally:
        if cluster is not None:
            cluster.stop()
        if args.keep:
            print(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    failed = [name for name, ok in report["checks"].items() if not ok]
    print(f"rehearsal: {len(report['checks']) - len(failed)} passed, {len(failed)} failed -> {args.out}")
    for name in failed:
        print(f"  FAILED {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
