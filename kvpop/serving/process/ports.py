"""The ports a server is about to listen on, checked before anything is started.

Why: a port held by another process (often a child of an earlier server that outlived it) used to be
found only by the process that could not bind it: the OpenAI API exited, was restarted again and again
beside a healthy Triton, and the supervisor finally gave up and stopped that Triton with it. One error
at start-up that names the port, what it is for and who holds it is what an operator can act on.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class BusyPort:
    role: str  # what the server wanted it for: "HTTP", "gRPC", "metrics", "health", "OpenAI API"
    port: int
    holder: str  # who holds it, as far as this user can tell

    def __str__(self) -> str:
        return f"{self.role} port {self.port} is in use by {self.holder}"


class PortInUseError(RuntimeError):
    """Ports the server needs are taken (or named twice)."""

    def __init__(self, busy: list[BusyPort]) -> None:
        self.busy = busy
        super().__init__("cannot start: " + "; ".join(map(str, busy)))


def port_holder(port: int) -> str:
    """The process listening on `port`: pid and command line, when this user may see them."""
    try:
        listeners = [connection for connection in psutil.net_connections("inet")
                     if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port]
    except psutil.AccessDenied:
        listeners = []
    for connection in listeners:
        if connection.pid:
            try:
                process = psutil.Process(connection.pid)
                command = " ".join(" ".join(process.cmdline()).split())
                return f"pid {process.pid} ({command[:160] or process.name()})"
            except psutil.Error:
                return f"pid {connection.pid}"
    return "another process (not visible to this user)" if listeners else "another socket"


def can_bind(address: str, port: int) -> bool:
    """Whether a listening socket could bind (address, port) now (as the servers do, with SO_REUSEADDR)."""
    family, kind, protocol, _, socket_address = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(socket_address)
        except OSError:
            return False
    return True


def check_ports(address: str, ports: dict[str, int]) -> None:
    """Raise PortInUseError naming every port of `ports` (role -> port; 0: not used) that is taken or
    named for two roles."""
    busy, roles = [], {}
    for role, port in ports.items():
        if not port:
            continue
        if port in roles:
            busy.append(BusyPort(role, port, f"this server's own {roles[port]} port (choose different ports)"))
        elif not can_bind(address, port):
            busy.append(BusyPort(role, port, port_holder(port)))
        roles.setdefault(port, role)
    if busy:
        raise PortInUseError(busy)
