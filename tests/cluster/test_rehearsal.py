"""The node deployment rehearsed on this machine (`make test-cluster`, not part of `make test`):
three real tritonservers behind a real nginx running the production config, one killed with SIGKILL.
The rehearsal program prints and saves its figures (build/results/cluster/rehearsal.json); this test runs it and
reports each of its checks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from deploy.nodes import rehearsal

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OUT = Path(os.environ.get("KVPOP_REHEARSAL_OUT", rehearsal.REPO_ROOT / "build" / "results" / "cluster" / "rehearsal.json"))


@pytest.fixture(scope="module")
def report(tiny_onnx_model_dir) -> dict:
    if shutil.which("nginx") is None:
        pytest.fail("nginx not installed: run `make system-deps`")
    assert rehearsal.main(["--out", str(OUT), "--exported-model", str(tiny_onnx_model_dir)]) in (0, 1)
    return json.loads(OUT.read_text())


@pytest.mark.parametrize("check", [
    "spread: no failed request",
    "spread: each replica within 5 points of its weight's share",
    "spread: Triton's counters agree with nginx's log",
    "sessions: every HTTP session stayed on one replica",
    "sessions: every gRPC session stayed on one replica",
    "failover: no failed request, those in flight on the killed replica retried on another",
    "failover: the killed replica was taken out",
    "failover: the others served while it was out",
    "failover: it came back in and served again",
])
def test_rehearsal(report, check):
    assert report["checks"][check], json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1)
