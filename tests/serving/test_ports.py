"""A port the server needs that is already taken is one clear error at start-up, naming the port, what it
was for and who holds it, before anything is started (not a child restarted until the server gives up)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvpop.serving.process.ports import PortInUseError, check_ports
from kvpop.serving.process.tritonserver import free_port


@pytest.fixture
def held_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_taken_port_is_named_with_its_role_and_holder(held_port):
    with pytest.raises(PortInUseError) as raised:
        check_ports("127.0.0.1", {"HTTP": free_port(), "OpenAI API": held_port, "health": 0})
    [busy] = raised.value.busy
    assert (busy.role, busy.port) == ("OpenAI API", held_port)
    assert f"OpenAI API port {held_port} is in use by pid {os.getpid()} (" in str(raised.value)
    with pytest.raises(PortInUseError, match=f"port {held_port} is in use"):  # any address overlaps it
        check_ports("0.0.0.0", {"HTTP": held_port})


def test_a_port_named_twice_is_refused():
    port = free_port()
    with pytest.raises(PortInUseError, match=f"gRPC port {port} is in use by this server's own HTTP port"):
        check_ports("127.0.0.1", {"HTTP": port, "gRPC": port})


def test_the_launcher_stops_at_a_taken_port_before_starting_anything(tmp_path, held_port):
    repository = tmp_path / "models"
    (repository / "kvpop_engine" / "1").mkdir(parents=True)
    (repository / "kvpop_engine" / "1" / "model_spec.json").write_text("{}")  # an export is there
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port(), "health": free_port(), "openai": held_port}
    command = [sys.executable, "-m", "kvpop.serving.process.launcher", f"--model-repository={repository}", "--address=127.0.0.1",
               f"--log-file={tmp_path / 'run' / 'tritonserver.log'}", f"--state-dir={tmp_path / 'state'}",
               *(f"--{name}-port={port}" for name, port in ports.items())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"OpenAI API port {held_port} is in use by pid {os.getpid()}" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "tritonserver.log").exists()  # no server was started
    check_ports("127.0.0.1", {name: port for name, port in ports.items() if name != "openai"})  # nothing kept
