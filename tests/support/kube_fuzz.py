"""Random answers of a hostile Kubernetes API server, for the watcher's fuzz test.

`ResponseMaker.answer` builds the raw HTTP/1.1 response to one LIST or WATCH:
mostly ConfigMap lists and watch events of plausible shape with some fields
of the wrong type or missing, now and then bytes cut, flipped or inserted
(deep brackets, invalid UTF-8, stray newlines), odd status codes and headers
(Retry-After that is no number, a Content-Length that lies, an encoding the
body does not have), bad chunk framing and streams that end early. Seeded
(`random.Random`), so a failure is reproduced by its seed. The test
(tests/kube/test_watch_fuzz.py) checks what the watcher does with it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.factories import clusterd_job, configmap

STATUSES = (200,) * 12 + (201, 204, 301, 302, 304, 400, 401, 403, 404, 410, 429, 500, 503, 999)
# Values that appear where another type belongs.
ODD_VALUES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    1.5,
    1e308,
    "",
    "x",
    [],
    {},
    [1, [2]],
    {"a": {"b": None}},
    "\ufffd",
    10**30,
    "9" * 5000,
)
ODD_KEYS = ("metadata", "data", "code", "type", "object", "items", "resourceVersion", "continue")
INSERTS = (b"[" * 12_000, b"\xff\xfe", b"\n", b'"', b"{", b"\r\n0\r\n\r\n", b"\x00")
RETRY_AFTER = ("0", "nan", "-5", "Wed, 21 Oct 2015 07:28:00 GMT", "x", "0.001")
ENCODINGS = ("gzip", "deflate", "br", "zstd", "bogus", "gzip, gzip")


@dataclass
class Answer:
    """The bytes to send, in parts (one chunk each when chunked)."""

    head: bytes
    parts: list[bytes]
    # False: close the connection after this answer.
    keep_alive: bool


class ResponseMaker:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.version = 100

    def answer(self, watch: bool) -> Answer:
        rng = self.rng
        status = rng.choice(STATUSES)
        headers = [("Content-Type", rng.choice(["application/json", "text/html", "x"]))]
        if rng.random() < 0.2:
            headers.append(("Retry-After", rng.choice(RETRY_AFTER)))
        if status in (301, 302):
            headers.append(("Location", rng.choice(["/api/v1/configmaps", "ftp://x", ""])))
        if rng.random() < 0.05:
            headers.append(("Content-Encoding", rng.choice(ENCODINGS)))
        if status != 200:
            parts = [self._bytes(json.dumps(self._mutate(_status(status))).encode())]
        elif watch:
            parts = self._watch_lines()
        else:
            parts = [self._bytes(json.dumps(self._mutate(self._list())).encode())]
        head = f"HTTP/1.1 {status} X\r\n".encode()
        if rng.random() < 0.03:
            head = rng.choice([b"HTTP/1.1 200\r\n", b"HTTP/2 200 OK\r\n", b"junk\r\n"])
        framing = rng.random()
        if framing < 0.5:
            length = sum(map(len, parts))
            if rng.random() < 0.05:
                length = rng.choice([length + 10, max(0, length - 5), -1, 10**20])
            headers.append(("Content-Length", str(length)))
            parts = [b"".join(parts)]
        elif framing < 0.95:
            headers.append(("Transfer-Encoding", "chunked"))
            parts = [self._chunk(part) for part in parts]
            if rng.random() < 0.9:
                parts.append(b"0\r\n\r\n")
        else:
            headers.append(("Connection", "close"))
        head += b"".join(f"{name}: {value}\r\n".encode() for name, value in headers) + b"\r\n"
        return Answer(head, parts, framing < 0.95 and rng.random() > 0.1)

    def _chunk(self, part: bytes) -> bytes:
        size = f"{len(part):x}"
        if self.rng.random() < 0.03:
            size = self.rng.choice(["zz", "-1", "f" * 18, ""])
        return size.encode() + b"\r\n" + part + b"\r\n"

    def _configmap(self) -> dict[str, Any]:
        job = clusterd_job(f"j{self.rng.randrange(5)}")
        name, data = job.configmaps(self.rng.choice(["running", "pending", "complete"]))[0]
        return listed_configmap(job.namespace, name, data, str(self.version))

    def _list(self) -> dict[str, Any]:
        self.version += 1
        metadata: dict[str, Any] = {"resourceVersion": str(self.version)}
        if self.rng.random() < 0.2:
            metadata["continue"] = self.rng.choice(["token", "", 5, None])
        items = [self._configmap() for _ in range(self.rng.randrange(4))]
        return {"kind": "ConfigMapList", "metadata": metadata, "items": items}

    def _watch_lines(self) -> list[bytes]:
        lines = []
        for _ in range(self.rng.randrange(6)):
            self.version += 1
            kind = self.rng.choice(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "ODD"])
            if kind == "ERROR":
                obj = _status(self.rng.choice([410, 500, 401, 429, "410", None, 999]))
            elif kind == "BOOKMARK":
                obj = {"kind": "ConfigMap", "metadata": {"resourceVersion": str(self.version)}}
            else:
                obj = self._configmap()
            line = self._bytes(json.dumps(self._mutate({"type": kind, "object": obj})).encode())
            lines.append(line + self.rng.choice([b"\n", b"\n", b"\n\n", b"\r\n", b""]))
        return lines

    def _mutate(self, value: Any) -> Any:
        """`value` with, now and then, a member dropped, a value of another type or a
        string cut short."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.04:
            return rng.choice(ODD_VALUES)
        if roll < 0.06:
            return [[[[[[]]]]]]
        if isinstance(value, dict):
            kept = {key: self._mutate(item) for key, item in value.items() if rng.random() > 0.03}
            if rng.random() < 0.03:
                kept[rng.choice(ODD_KEYS)] = rng.choice(ODD_VALUES)
            return kept
        if isinstance(value, list):
            return [self._mutate(item) for item in value if rng.random() > 0.03]
        if isinstance(value, str) and rng.random() < 0.05:
            return value[: rng.randrange(len(value) + 1)]
        return value

    def _bytes(self, data: bytes) -> bytes:
        """`data`, or one time in seven that with a few bytes changed, cut or inserted."""
        rng = self.rng
        if rng.random() < 6 / 7 or not data:
            return data
        changed = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            at = rng.randrange(len(changed) or 1)
            roll = rng.random()
            if roll < 0.4 and changed:
                changed[at] = rng.randrange(256)
            elif roll < 0.7:
                del changed[at : at + rng.randrange(1, 20)]
            else:
                changed[at:at] = rng.choice(INSERTS)
        return bytes(changed)


def listed_configmap(
    namespace: str, name: str, data: Mapping[str, str], version: str
) -> dict[str, Any]:
    """`configmap` as a LIST or WATCH carries it: with a uid and a resourceVersion."""
    listed = configmap(namespace, name, data)
    listed["metadata"].update(uid=f"uid-{name}", resourceVersion=version)
    return listed


def _status(code: object) -> dict[str, Any]:
    return {"kind": "Status", "code": code, "message": "refused"}
