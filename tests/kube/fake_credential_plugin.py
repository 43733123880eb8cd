"""A client-go exec credential plugin for the tests, run as `python fake_credential_plugin.py PLAN`.

PLAN is a JSON file the test writes (and may rewrite between runs):

    {"calls": "<file>", "record_env": ["NAME", ...], "responses": [{...}, ...]}

Each run appends one JSON line to `calls` (its extra arguments, the listed
environment variables, the parsed KUBERNETES_EXEC_INFO, whether stdin is
/dev/null, its pid) and answers with `responses[n]` for the n-th run (the last one
repeats). A response may set `token`, `cert_file` and `key_file` (PEM files
sent as clientCertificateData/clientKeyData), `expires_in` (seconds from now)
or `expiration` (raw text), `api_version` (default: the one requested),
`stderr`, `exit`, `sleep` (seconds), `stdout` (raw text instead of an
ExecCredential), `stdout_bytes` / `stderr_bytes` (that much filler).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    info = json.loads(os.environ.get("KUBERNETES_EXEC_INFO", "null"))
    calls = Path(plan["calls"])
    previous = calls.read_text().count("\n") if calls.exists() else 0
    devnull = os.stat(os.devnull)
    stdin = os.fstat(0)
    record = {
        "pid": os.getpid(),
        "args": sys.argv[2:],
        "env": {name: os.environ.get(name) for name in plan.get("record_env", [])},
        "exec_info": info,
        "stdin_is_devnull": (stdin.st_rdev, stdin.st_ino) == (devnull.st_rdev, devnull.st_ino),
    }
    with calls.open("a") as f:
        f.write(json.dumps(record) + "\n")

    responses = plan["responses"]
    response = responses[min(previous, len(responses) - 1)]
    if "stderr_bytes" in response:
        sys.stderr.write("e" * response["stderr_bytes"])
    if "stderr" in response:
        sys.stderr.write(response["stderr"])
    sys.stderr.flush()
    time.sleep(response.get("sleep", 0))
    if "stdout_bytes" in response:
        sys.stdout.write("x" * response["stdout_bytes"])
    elif "stdout" in response:
        sys.stdout.write(response["stdout"])
    else:
        status: dict[str, str] = {}
        if "token" in response:
            status["token"] = response["token"]
        if "cert_file" in response:
            status["clientCertificateData"] = Path(response["cert_file"]).read_text()
            status["clientKeyData"] = Path(response["key_file"]).read_text()
        if "expires_in" in response:
            expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(
                seconds=response["expires_in"]
            )
            status["expirationTimestamp"] = expires.strftime("%Y-%m-%dT%H:%M:%SZ")
        if "expiration" in response:
            status["expirationTimestamp"] = response["expiration"]
        version = response.get("api_version") or (info or {}).get("apiVersion")
        credential = {"apiVersion": version, "kind": "ExecCredential", "status": status}
        sys.stdout.write(json.dumps(credential))
    return int(response.get("exit", 0))


if __name__ == "__main__":
    sys.exit(main())
