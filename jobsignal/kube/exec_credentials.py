"""Exec credential plugins: a kubeconfig user's ``exec`` command, run for credentials.

This module owns running the plugin and caching what it returns, as client-go
does for ``aws eks get-token``, ``gke-gcloud-auth-plugin`` or ``kubelogin``.
The plugin is started with ``trio.run_process``: its arguments, the process
environment plus the entry's ``env`` list and ``KUBERNETES_EXEC_INFO`` (an
``ExecCredential`` request with ``spec.interactive`` false and, when the
kubeconfig asks for it, ``spec.cluster``), no standard input, at most
:data:`RUN_TIMEOUT` seconds and :data:`MAX_STDOUT` bytes of output. It prints
an ``ExecCredential`` whose ``status`` holds a bearer ``token`` and/or a client
certificate and key (``clientCertificateData``, ``clientKeyData``).

A credential is reused until shortly before its ``expirationTimestamp``
(measured on trio's clock from the moment it arrived), or, without one, until
the API server refuses it (:meth:`ExecCredentials.invalidate` after a 401).
Failures are :class:`ExecCredentialError` with a one-line message naming the
plugin and kubeconfig entry; plugin output is never quoted (it holds the
secret), its standard error at most ~200 characters.

Parsing the kubeconfig ``exec`` stanza is kube.credentials' job (into a
kube.exec_plugin ``ExecPlugin``); applying the credential to requests is
kube.api's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

import trio

from jobsignal.kube.exec_plugin import ExecCredentialError, ExecPlugin
from jobsignal.util.text import quote

__all__ = ["EXEC_INFO_ENV", "MAX_STDOUT", "RUN_TIMEOUT", "ExecCredential", "ExecCredentials"]

log = logging.getLogger(__name__)

EXEC_INFO_ENV = "KUBERNETES_EXEC_INFO"
#: Seconds a plugin may run before it is killed.
RUN_TIMEOUT = 30.0
#: Bytes of standard output accepted (a token or a certificate chain is a few KiB).
MAX_STDOUT = 1024 * 1024
#: Bytes of standard error kept for the error message; the rest is read and dropped.
MAX_STDERR_KEPT = 16 * 1024
#: How long before expiry a credential is renewed, at most; never more than a
#: tenth of its lifetime, so a short-lived credential is still reused.
REFRESH_MARGIN = 30.0
STDERR_QUOTE = 200


@dataclass(frozen=True, eq=False)
class ExecCredential:
    """What one plugin run returned. Secrets stay out of repr."""

    token: str | None = field(repr=False)
    #: PEM, possibly with intermediates; set together with client_key.
    client_certificate: bytes | None = field(repr=False)
    client_key: bytes | None = field(repr=False)
    #: trio time after which the plugin runs again; None: until refused.
    refresh_at: float | None


class ExecCredentials:
    """The credentials of one kubeconfig user with an ``exec`` plugin.

    :meth:`get` returns the cached credential or runs the plugin; concurrent
    callers share one run. *wall_clock* (``time.time``) is read only to turn
    the plugin's ``expirationTimestamp`` into a duration; everything after that
    runs on trio's clock.
    """

    def __init__(
        self,
        plugin: ExecPlugin,
        *,
        wall_clock: Callable[[], float] = time.time,
        timeout: float = RUN_TIMEOUT,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.plugin = plugin
        self._wall_clock = wall_clock
        self._timeout = timeout
        #: The base environment; None means the process's own, read at each run.
        self._environ = environ
        self._cached: ExecCredential | None = None
        self._lock = trio.Lock()
        #: Plugin runs started, successful or not.
        self.runs = 0

    @property
    def description(self) -> str:
        """Safe for logs: which program provides the credentials."""
        return f"exec plugin {os.path.basename(self.plugin.command)!r}"

    async def get(self) -> tuple[ExecCredential, bool]:
        """The credential to use now, and whether this call ran the plugin for it."""
        async with self._lock:
            cached = self._cached
            if cached is not None and (
                cached.refresh_at is None or trio.current_time() < cached.refresh_at
            ):
                return cached, False
            self._cached = None
            fresh = await self._run()
            self._cached = fresh
            return fresh, True

    def invalidate(self, credential: ExecCredential | None = None) -> None:
        """Run the plugin again on the next :meth:`get` (after a 401).

        With *credential*, only if it is still the cached one: many requests
        refused with the same credential cause one new run, not one each.
        """
        if credential is None or credential is self._cached:
            self._cached = None

    # -- running the plugin

    def _error(self, problem: str) -> ExecCredentialError:
        return ExecCredentialError(f"{self.plugin.label} {problem}")

    async def _run(self) -> ExecCredential:
        plugin = self.plugin
        self.runs += 1
        environ = os.environ if self._environ is None else self._environ
        env = {**environ, **dict(plugin.env), EXEC_INFO_ENV: plugin.exec_info}
        stdout = _Capture(MAX_STDOUT)
        stderr = _Capture(MAX_STDERR_KEPT)
        process: trio.Process | None = None
        spawn_error: OSError | None = None
        with trio.move_on_after(self._timeout) as deadline:
            async with trio.open_nursery() as nursery:
                try:
                    process = await nursery.start(
                        partial(
                            trio.run_process,
                            [plugin.command, *plugin.args],
                            stdin=subprocess.DEVNULL,  # no terminal: never wait for a human
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=env,
                            check=False,
                            deliver_cancel=_kill,
                        )
                    )
                except OSError as error:
                    spawn_error = error
                else:
                    assert process.stdout is not None and process.stderr is not None
                    # Over the limit, stdout cancels the nursery, which kills the plugin.
                    nursery.start_soon(stdout.drain, process.stdout, nursery.cancel_scope)
                    nursery.start_soon(stderr.drain, process.stderr, None)
        if spawn_error is not None:
            raise self._spawn_error(spawn_error)
        if deadline.cancelled_caught:
            raise self._error(f"did not finish within {self._timeout:g}s and was killed")
        if stdout.overflowed:
            raise self._error(f"printed more than {MAX_STDOUT} bytes and was killed")
        assert process is not None
        if process.returncode != 0:
            raise self._error(f"{_exit_text(process.returncode)}{self._stderr_note(stderr)}")
        credential = self._parse(stdout.data)
        log.debug(
            "%s returned %s%s",
            plugin.label,
            " and ".join(
                part
                for part, present in (
                    ("a token", credential.token is not None),
                    ("a client certificate", credential.client_certificate is not None),
                )
                if present
            ),
            "" if credential.refresh_at is None else " (with an expiry)",
        )
        return credential

    def _spawn_error(self, error: OSError) -> ExecCredentialError:
        if isinstance(error, FileNotFoundError):
            hint = self.plugin.install_hint
            note = f"; install hint: {quote(' '.join(hint.split()))}" if hint else ""
            return self._error(f"cannot be run: command not found{note}")
        return self._error(f"cannot be run: {error.strerror or type(error).__name__}")

    def _stderr_note(self, stderr: _Capture) -> str:
        text = " ".join(stderr.data.decode("utf-8", "replace").split())
        return f"; stderr: {quote(text, STDERR_QUOTE)}" if text else " (no stderr)"

    def _parse(self, output: bytes) -> ExecCredential:
        # Never quote the output itself: it is the credential.
        try:
            document = json.loads(output)
        except ValueError:
            raise self._error("printed something that is not JSON") from None
        except RecursionError:
            raise self._error("printed JSON nested too deep to read") from None
        if not isinstance(document, dict):
            raise self._error("did not print a JSON object")
        if document.get("kind") != "ExecCredential":
            raise self._error(f"printed kind {quote(document.get('kind'))}, not ExecCredential")
        version = document.get("apiVersion")
        if version != self.plugin.api_version:
            raise self._error(
                f"answered with apiVersion {quote(version)}, but the kubeconfig asks for "
                f"{self.plugin.api_version}"
            )
        status = document.get("status")
        if not isinstance(status, dict):
            raise self._error("returned no status")
        token = self._status_str(status, "token")
        cert = self._status_str(status, "clientCertificateData")
        key = self._status_str(status, "clientKeyData")
        if not token and not cert and not key:
            raise self._error("returned neither a token nor a client certificate and key")
        if bool(cert) != bool(key):
            missing = "clientKeyData" if not key else "clientCertificateData"
            raise self._error(f"returned a client certificate or key but no {missing}")
        return ExecCredential(
            token=token or None,
            client_certificate=cert.encode() if cert else None,
            client_key=key.encode() if key else None,
            refresh_at=self._refresh_at(status.get("expirationTimestamp")),
        )

    def _status_str(self, status: Mapping[str, Any], name: str) -> str:
        value = status.get(name)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self._error(f"returned a status.{name} that is not a string")
        return value.strip()

    def _refresh_at(self, expiration: object) -> float | None:
        if expiration is None or expiration == "":
            return None
        expires = _parse_rfc3339(expiration)
        if expires is None:
            raise self._error(
                f"returned an expirationTimestamp that is not an RFC 3339 time: {quote(expiration)}"
            )
        lifetime = expires - self._wall_clock()
        # An already expired credential serves the request at hand, then the plugin runs again.
        margin = min(REFRESH_MARGIN, max(lifetime, 0.0) / 10)
        return trio.current_time() + lifetime - margin


class _Capture:
    """Reads one output pipe of the plugin to its end, keeping at most *limit* bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._chunks: list[bytes] = []
        self._kept = 0
        self.overflowed = False

    @property
    def data(self) -> bytes:
        return b"".join(self._chunks)

    async def drain(self, stream: trio.abc.ReceiveStream, stop: trio.CancelScope | None) -> None:
        """Read to EOF; past the limit, cancel *stop* or, without one, keep reading and drop.

        Dropping still reads: a plugin blocked on a full stderr pipe would never exit.
        """
        async with stream:
            while chunk := await stream.receive_some(65536):
                room = self._limit - self._kept
                if len(chunk) > room:
                    self.overflowed = True
                    if stop is not None:
                        stop.cancel()
                        return
                    chunk = chunk[:room]
                if chunk:
                    self._chunks.append(bytes(chunk))
                    self._kept += len(chunk)


async def _kill(process: trio.Process) -> None:
    # A plugin over its time or output budget gets no grace period.
    process.kill()


def _exit_text(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _parse_rfc3339(value: object) -> float | None:
    """Seconds since the epoch, or None unless *value* is a time with a zone."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if len(text) < 20 or text[10] not in "Tt":
        return None  # RFC 3339 always has a date, a time and an offset
    try:
        moment = datetime.fromisoformat(text[:10] + "T" + text[11:].upper())
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()
