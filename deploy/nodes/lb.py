#!/usr/bin/env python3
"""The load balancer in front of the GPU nodes: render its nginx config, and health-check the nodes.

Open-source nginx only checks upstreams passively (a failed request takes a node out for
`fail_timeout`). `watch` adds the active part: it polls every node's readiness URL every few seconds
and, when a node falls (`--fall` failed probes in a row) or rises again (`--rise` good ones),
re-renders the config with that node marked `down` or back in and reloads nginx. Marking a node
`down` instead of deleting it keeps the consistent-hash ring: only that node's sessions move.

Standard library only, so it runs with any python3 on the balancer host:

    python3 deploy/nodes/lb.py render --nodes nodes.txt --out /etc/kvpop-lb/nginx.conf
    python3 deploy/nodes/lb.py watch  --nodes nodes.txt --out /etc/kvpop-lb/nginx.conf \\
        --reload-command "docker kill -s HUP kvpop-lb"

A nodes file has one node per line, `#` starts a comment:

    # name    http            grpc            ready                         weight
    main      10.0.0.10:8000  10.0.0.10:8001  http://10.0.0.10:8003/ready   1
    worker1   10.0.0.11:8000  10.0.0.11:8001  http://10.0.0.11:8003/ready   2
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

TEMPLATE = Path(__file__).resolve().parent / "nginx.conf.template"


@dataclass(frozen=True)
class Node:
    name: str
    http: str  # host:port of Triton's HTTP endpoint
    grpc: str  # host:port of Triton's gRPC endpoint
    ready: str  # readiness URL: 200 while the node can answer
    weight: int = 1


@dataclass(frozen=True)
class RenderOptions:
    http_listen: str = "0.0.0.0:8000"
    grpc_listen: str = "0.0.0.0:8001"
    run_dir: str = "/var/run/kvpop-lb"
    access_log: str = "/dev/stdout"
    error_log: str = "/dev/stderr"
    worker_processes: str = "auto"
    max_fails: int = 1
    fail_timeout_s: int = 10
    openai_port: int = 9000  # each node's OpenAI-compatible API: the node's HTTP host, this port


def read_nodes(path: Path) -> list[Node]:
    nodes = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (4, 5):
            raise ValueError(f"{path}:{number}: expected `name http grpc ready [weight]`, got {line!r}")
        weight = int(fields[4]) if len(fields) == 5 else 1
        if weight < 1:
            raise ValueError(f"{path}:{number}: weight must be >= 1")
        nodes.append(Node(*fields[:4], weight))
    if not nodes:
        raise ValueError(f"{path}: no nodes")
    if len({node.name for node in nodes}) != len(nodes):
        raise ValueError(f"{path}: node names must be unique")
    return nodes


def render(nodes: list[Node], options: RenderOptions, down: frozenset[str] = frozenset()) -> str:
    """The nginx config for these nodes; nodes named in `down` stay on the hash ring but get no traffic."""
    def servers(address: Callable[[Node], str]) -> str:
        lines = []
        for node in nodes:
            flags = f"weight={node.weight} max_fails={options.max_fails} fail_timeout={options.fail_timeout_s}s"
            lines.append(f"        server {address(node)} {flags}{' down' if node.name in down else ''};  # {node.name}")
        return "\n".join(lines)

    values = {
        "WORKER_PROCESSES": options.worker_processes,
        "PID_FILE": f"{options.run_dir}/nginx.pid",
        "RUN_DIR": options.run_dir,
        "ERROR_LOG": options.error_log,
        "ACCESS_LOG": options.access_log,
        "HTTP_LISTEN": options.http_listen,
        "GRPC_LISTEN": options.grpc_listen,
        "HTTP_SERVERS": servers(lambda node: node.http),
        "GRPC_SERVERS": servers(lambda node: node.grpc),
        "OPENAI_SERVERS": servers(lambda node: f"{node.http.rsplit(':', 1)[0]}:{options.openai_port}"),
    }
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def write_config(path: Path, text: str) -> bool:
    """Write atomically; False when nothing changed."""
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(path.suffix + ".new")
    scratch.write_text(text)
    scratch.replace(path)
    return True


def probe(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass
class NodeHealth:
    healthy: bool = True  # nodes start in: a node that is not up yet gets taken out after `fall` probes
    streak: int = 0  # consecutive probes that disagree with `healthy`
    changed_at: float = 0.0


class HealthWatcher:
    """Active health checks for nginx: probe, debounce, re-render, reload."""

    def __init__(self, nodes: list[Node], out: Path, options: RenderOptions, reload_command: list[str],
                 fall: int = 2, rise: int = 2, probe_timeout_s: float = 2.0, state_file: Path | None = None):
        self.nodes, self.out, self.options = nodes, Path(out), options
        self.reload_command, self.fall, self.rise = reload_command, fall, rise
        self.probe_timeout_s, self.state_file = probe_timeout_s, state_file
        self.health = {node.name: NodeHealth(changed_at=time.time()) for node in nodes}
        self.events: list[dict] = []

    def down(self) -> frozenset[str]:
        out = frozenset(name for name, state in self.health.items() if not state.healthy)
        # With every node failing, taking them all out only turns errors into "no live upstreams":
        # leave them in and let nginx's passive checks pick whatever answers.
        return frozenset() if len(out) == len(self.nodes) else out

    def check_once(self) -> bool:
        """Probe every node once; re-render and reload when the set of nodes in service changed."""
        before = self.down()
        for node in self.nodes:
            ok = probe(node.ready, self.probe_timeout_s)
            state = self.health[node.name]
            state.streak = 0 if ok == state.healthy else state.streak + 1
            if state.streak >= (self.rise if ok else self.fall):
                state.healthy, state.streak, state.changed_at = ok, 0, time.time()
                self.events.append({"time": state.changed_at, "node": node.name, "healthy": ok})
                print(f"[lb] {node.name} {'UP' if ok else 'DOWN'} ({node.ready})", flush=True)
        changed = self.down() != before
        if write_config(self.out, render(self.nodes, self.options, self.down())) and self.reload_command:
            subprocess.run(self.reload_command, check=False)
        self.write_state()
        return changed

    def write_state(self) -> None:
        if self.state_file is None:
            return
        state = {"nodes": {name: asdict(health) for name, health in self.health.items()},
                 "down": sorted(self.down()), "events": self.events}
        write_config(Path(self.state_file), json.dumps(state, indent=1))

    def run(self, interval_s: float) -> None:
        while True:
            started = time.monotonic()
            self.check_once()
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def render_options(args: argparse.Namespace) -> RenderOptions:
    return RenderOptions(args.http_listen, args.grpc_listen, args.run_dir, args.access_log, args.error_log,
                         args.worker_processes, args.max_fails, args.fail_timeout, args.openai_port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lb.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("render", "watch"):
        command = commands.add_parser(name)
        command.add_argument("--nodes", type=Path, required=True)
        command.add_argument("--out", type=Path, required=True, help="the nginx.conf to write")
        command.add_argument("--http-listen", default=RenderOptions.http_listen)
        command.add_argument("--grpc-listen", default=RenderOptions.grpc_listen)
        command.add_argument("--run-dir", default=RenderOptions.run_dir, help="pid file and temp files (must exist)")
        command.add_argument("--access-log", default=RenderOptions.access_log)
        command.add_argument("--error-log", default=RenderOptions.error_log)
        command.add_argument("--worker-processes", default=RenderOptions.worker_processes)
        command.add_argument("--max-fails", type=int, default=RenderOptions.max_fails)
        command.add_argument("--fail-timeout", type=int, default=RenderOptions.fail_timeout_s, help="seconds")
        command.add_argument("--openai-port", type=int, default=RenderOptions.openai_port,
                             help="the nodes' OpenAI-compatible API port (/v1 routes there)")
    watch = commands.choices["watch"]
    watch.add_argument("--interval", type=float, default=5.0, help="seconds between probes of each node")
    watch.add_argument("--fall", type=int, default=2, help="failed probes in a row that take a node out")
    watch.add_argument("--rise", type=int, default=2, help="good probes in a row that bring it back")
    watch.add_argument("--probe-timeout", type=float, default=2.0)
    watch.add_argument("--reload-command", default="nginx -s reload", help="run after each config change")
    watch.add_argument("--state-file", type=Path, help="JSON with each node's health and the transitions")
    args = parser.parse_args(argv)

    nodes = read_nodes(args.nodes)
    if args.command == "render":
        write_config(args.out, render(nodes, render_options(args)))
        return 0
    watcher = HealthWatcher(nodes, args.out, render_options(args), shlex.split(args.reload_command),
                            args.fall, args.rise, args.probe_timeout, args.state_file)
    try:
        watcher.run(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
