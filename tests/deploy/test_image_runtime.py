"""The container image's interpreter settings, run here: a server under deploy/Dockerfile's ENV.

The image runs jobsignal with PYTHONOPTIMIZE=2, as `python -OO`: docstrings
and asserts are not loaded (2 MB less memory at idle, docs/architecture.md
section 10). Nothing jobsignal or a dependency does at run time may need
either. A server started with exactly the image's variables (and a PATH)
answers grpcio's health check, a Register and a List subscription, serves
/metrics, and drains and stops on SIGTERM, as it does without them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.grpcio import GrpcioClients, GrpcioStubs, health_statuses
from tests.support.manifests import DOCKERFILE, _dockerfile_env, _dockerfile_instructions
from tests.support.serve_process import serving_demo
from tests.support.waiting import wait_until_blocking


def image_env() -> dict[str, str]:
    env = _dockerfile_env(_dockerfile_instructions(DOCKERFILE.read_text()))
    return {**env, "PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}


def test_the_image_runs_python_with_docstrings_and_asserts_stripped() -> None:
    flags = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.flags.optimize, __debug__)"],
        env=image_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert flags.stdout.split() == ["2", "False"]


def test_a_server_with_the_images_settings_serves_grpcio_and_metrics(
    grpc_clients: GrpcioClients, grpcio_stubs: GrpcioStubs
) -> None:
    with serving_demo("--drain-delay", "0", env=image_env()) as serving:
        wait_until_blocking(lambda: serving.get("/readyz")[0] == 200, within=30, what="/readyz 200")
        assert health_statuses(grpcio_stubs, serving.target, "", "job.Job") == {
            "": "SERVING",
            "job.Job": "SERVING",
        }
        client = grpc_clients.connect(serving.target)
        client_id = client.register_id("DefaultUser1")
        first = next(client.subscribe_list("DefaultUser1", client_id, timeout=30))
        assert first.JobTotalNum >= 1 and first.jobSummarySignals[0].namespace == "demo"
        status, metrics = serving.get("/metrics")
        assert status == 200 and b"jobsignal_subscribers" in metrics

        serving.process.send_signal(signal.SIGTERM)
        assert serving.process.wait(timeout=15) == 0
