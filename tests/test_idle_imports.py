"""What a serving jobsignal leaves unimported: the protobuf runtime, PyYAML, the client.

A fresh interpreter (this one has grpcio and protobuf loaded by other tests)
serves the embedded demo cluster, answers health Check and Watch, a Register
and a List subscription, and reports which of those modules it loaded. Server
reflection is the one caller of the protobuf runtime, loaded on its first call
(jobsignal/rpc/reflection.py); its answers are tested in tests/rpc/test_interop.py.
`jobsignal serve` with text logs loads neither the client commands,
jobsignal's gRPC client (with grpclib's), shtab nor python-json-logger; nor
the in-process events API, the TLS modules of the gRPC port or the exec
plugin runner.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support.cluster import write_kubeconfig
from tests.support.interpreter import report_of

ROOT = Path(__file__).resolve().parent.parent

SERVE_AND_REPORT = """
import json, sys
import trio
import jobsignal
from jobsignal.client import check_health, fetch_jobs

async def main():
    config = jobsignal.configure(listen="127.0.0.1:0", source="demo")
    async with trio.open_nursery() as nursery:
        server = await nursery.start(jobsignal.serve, config)
        with trio.fail_after(30):
            await server.ready.wait()
            options = jobsignal.SubscribeOptions("127.0.0.1", server.port, role="CCAgent")
            health = [await check_health(options, name) for name in ("", "job.Job")]
            jobs = await fetch_jobs(options)
        loaded = sorted(
            name for name in sys.modules
            # (not "google" itself: a namespace package some installs import at start-up)
            if name.split(".")[0] == "yaml"
            or name.startswith(("google.protobuf", "google._upb", "grpclib.reflection"))
        )
        print(json.dumps({"health": health, "jobs": len(jobs), "loaded": loaded}))
        server.request_shutdown()

trio.run(main)
"""


def test_a_serving_server_loads_neither_protobuf_nor_yaml() -> None:
    report = report_of(SERVE_AND_REPORT)
    assert report["health"] == ["SERVING", "SERVING"]
    assert report["jobs"] >= 0  # the snapshot arrived (the demo may hold no job yet)
    assert report["loaded"] == []


SERVE_COMMAND_AND_REPORT = """
import json, os, sys
import trio

from jobsignal import cli
from jobsignal.app import run_jobsignal
from jobsignal.config import load_config
from jobsignal.logs import configure_logging

args = cli.build_parser().parse_args(["serve", "--source", "demo", "--listen", "127.0.0.1:0"])
config = load_config(vars(args), os.environ)
configure_logging(config.log_level, config.log_format)

async def main():
    async with trio.open_nursery() as nursery:
        server = await nursery.start(run_jobsignal, config)
        with trio.fail_after(30):
            await server.ready.wait()
        loaded = sorted(
            name for name in sys.modules
            if name in (
                "jobsignal.client", "jobsignal.client_cli", "grpclib.client", "shtab",
                "jobsignal.json_logs", "pythonjsonlogger",
                "jobsignal.events", "jobsignal.embed", "jobsignal.rpc.tls",
                "jobsignal.rpc.tls_connections", "jobsignal.kube.exec_credentials",
            )
        )
        print(json.dumps({"loaded": loaded}))
        server.request_shutdown()

trio.run(main)
"""


def test_the_serve_command_loads_only_what_it_uses() -> None:
    assert report_of(SERVE_COMMAND_AND_REPORT) == {"loaded": []}


LOAD_AND_REPORT = """
import json, sys
from pathlib import Path
from jobsignal.kube.credentials import load_kubeconfig

connection = load_kubeconfig(Path(sys.argv[1]))
print(json.dumps({"server": connection.base_url, "yaml": "yaml" in sys.modules}))
"""


def test_a_json_kubeconfig_is_read_without_pyyaml(tmp_path: Path) -> None:
    """kubectl reads a JSON kubeconfig too (JSON is YAML); it needs no PyYAML (0.8 MB)."""
    yaml_file = write_kubeconfig(tmp_path / "config.yaml", "http://127.0.0.1:6443")
    json_file = tmp_path / "config.json"
    json_file.write_text(json.dumps(yaml.safe_load(yaml_file.read_text()), indent=2))
    reports = {
        name: report_of(LOAD_AND_REPORT, str(path))
        for name, path in (("yaml", yaml_file), ("json", json_file))
    }
    assert reports["yaml"] == {"server": "http://127.0.0.1:6443", "yaml": True}
    assert reports["json"] == {"server": "http://127.0.0.1:6443", "yaml": False}
