"""Where the Kubernetes API is and how to authenticate to it.

This module owns the credentials/connection layer: it turns the in-cluster
service-account mount or a kubeconfig file into a :class:`KubeConnection` (base
URL, the :class:`ssl.SSLContext` for its TLS connections, a bearer-token
provider, a log-safe description and the default namespace). It does no network
I/O. Every problem with the configuration is reported as a
:class:`KubeConfigError` whose message is one line, names the file, context,
cluster, user or field at fault, and never contains a secret.

Supported: service-account token, CA and namespace; kubeconfig ``server``,
``certificate-authority(-data)``, ``insecure-skip-tls-verify``,
``tls-server-name``, ``proxy-url`` (http and https proxies), ``token``,
``tokenFile``, ``client-certificate(-data)``, ``client-key(-data)`` and
``exec`` credential plugins (checked here, run by kube.exec_credentials);
``KUBECONFIG`` lists are merged like kubectl does. Without a ``proxy-url``
the proxy comes from the environment as client-go reads it (kube.proxies:
``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY`` with CIDRs). Not supported (rejected
with a message rather than ignored): auth-provider plugins, basic auth,
impersonation (``as``, ``as-uid``, ``as-groups``, ``as-user-extra``) and
socks proxies.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import socket
import ssl
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jobsignal.kube.exec_plugin import API_VERSIONS, ExecPlugin, exec_info
from jobsignal.kube.proxies import ProxyConfigError, proxy_for
from jobsignal.util.text import quote

if TYPE_CHECKING:
    from jobsignal.kube.exec_credentials import ExecCredentials

__all__ = [
    "SERVICE_ACCOUNT_ROOT",
    "KubeConfigError",
    "KubeConnection",
    "TokenSource",
    "discover",
    "load_client_certificate",
    "load_in_cluster",
    "load_kubeconfig",
]

SERVICE_ACCOUNT_ROOT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """The Kubernetes connection cannot be configured.

    The message is one user-facing line naming what is missing or broken (file
    path, context, cluster, user, field); it never contains a secret.
    """

    def __init__(self, message: str) -> None:
        # Paths and OS error texts could carry newlines; the message is meant
        # for a single log line or a CLI error.
        super().__init__(" ".join(message.split()))


class TokenSource:
    """A bearer token, either fixed or read from a file.

    File tokens (service-account tokens, kubeconfig ``tokenFile``) rotate, so
    :meth:`current` stats the file on every call and re-reads it when its
    identity, size or modification time changed. The kubelet replaces projected
    tokens through an atomic symlink swap, which changes the inode, so the stat
    check sees every rotation; :meth:`invalidate` forces a re-read anyway, for
    the caller to use after a 401. Reading is synchronous: it is one ``stat`` of
    a small local file, cheaper than making it async.
    """

    __slots__ = ("_cached", "_path", "_stamp")

    def __init__(self, *, token: str | None = None, path: Path | None = None) -> None:
        if (token is None) == (path is None):
            raise ValueError("TokenSource needs exactly one of token= or path=")
        self._path = path
        self._cached: str | None = token
        self._stamp: tuple[int, int, int, int] | None = None
        if path is not None:
            # Fail at start-up rather than on the first request.
            self.current()

    @classmethod
    def fixed(cls, token: str) -> TokenSource:
        """A token that never changes (kubeconfig ``token``)."""
        return cls(token=token)

    @classmethod
    def from_file(cls, path: Path) -> TokenSource:
        """A token read from *path* now and again whenever the file changes."""
        return cls(path=path)

    @property
    def path(self) -> Path | None:
        """The token file, or None for a fixed token."""
        return self._path

    @property
    def description(self) -> str:
        """Where the token comes from, safe for logs."""
        return "static token" if self._path is None else f"token file {self._path}"

    def current(self) -> str:
        """The token to send now; raises :class:`KubeConfigError` if the file is unusable."""
        if self._path is None:
            assert self._cached is not None
            return self._cached
        try:
            st = os.stat(self._path)
        except OSError as exc:
            raise KubeConfigError(
                f"cannot read token file {self._path}: {_os_reason(exc)}"
            ) from None
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp or self._cached is None:
            self._cached = self._read()
            self._stamp = stamp
        return self._cached

    def invalidate(self) -> None:
        """Forget the cached token so the next :meth:`current` re-reads the file."""
        if self._path is not None:
            self._stamp = None
            self._cached = None

    def _read(self) -> str:
        assert self._path is not None
        try:
            raw = self._path.read_bytes()
        except OSError as exc:
            raise KubeConfigError(
                f"cannot read token file {self._path}: {_os_reason(exc)}"
            ) from None
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise KubeConfigError(f"token file {self._path} is not ASCII text") from None
        if not token:
            raise KubeConfigError(f"token file {self._path} is empty")
        return token

    def __repr__(self) -> str:
        return f"<TokenSource {self.description}>"


@dataclass(frozen=True)
class KubeConnection:
    """Everything needed to build an ``httpx.AsyncClient`` for the API server.

    Requests go to ``base_url`` (through ``proxy`` when set: the cluster's
    ``proxy-url``, else the environment's proxy for ``base_url``), with an
    ``Authorization: Bearer <conn.token_source.current()>`` header when
    ``token_source`` is set, or the credentials of ``exec_credentials``
    (kube.api's ``open_kube_client`` does all of it). ``verify`` carries the CA
    (or, for an https server, the system roots), the client certificate and
    key, the ``tls-server-name`` override, or disabled verification; it is
    None for a plain-http server with no TLS setting.
    """

    base_url: str
    verify: ssl.SSLContext | None
    token_source: TokenSource | None
    description: str
    default_namespace: str | None
    #: The proxy for ``base_url``: the cluster's ``proxy-url``, else the one the
    #: environment gives it (it may hold proxy credentials: not for logs).
    proxy: str | None = field(default=None, repr=False)
    #: The user's exec credential plugin, run before requests as needed.
    exec_credentials: ExecCredentials | None = None


def load_in_cluster(
    environ: Mapping[str, str] = os.environ, root: Path = SERVICE_ACCOUNT_ROOT
) -> KubeConnection:
    """Connect as the pod's service account.

    Uses ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` and the
    ``token``, ``ca.crt`` and ``namespace`` files under *root*.
    """
    host = environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = environ.get("KUBERNETES_SERVICE_PORT", "").strip()
    if not host or not port:
        raise KubeConfigError(
            "in-cluster configuration needs KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise KubeConfigError(f"KUBERNETES_SERVICE_PORT is not a port number: {port!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal must be bracketed in a URL
    base_url = f"https://{host}:{int(port)}"
    proxy, proxy_note = _proxy_choice(None, base_url, environ)

    tokens = TokenSource.from_file(root / "token")
    ca_path = root / "ca.crt"
    context = _new_context()
    _load_ca(context, _read_file(ca_path, "service-account CA"), f"service-account CA {ca_path}")

    namespace: str | None = None
    try:
        namespace = (root / "namespace").read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        pass  # optional: callers then need an explicit namespace
    except (OSError, UnicodeDecodeError) as exc:
        raise KubeConfigError(
            f"cannot read service-account namespace {root / 'namespace'}: {_os_reason(exc)}"
        ) from None

    return KubeConnection(
        base_url=base_url,
        verify=context,
        token_source=tokens,
        description=(
            f"in-cluster service account (server {base_url}{proxy_note}, {tokens.description})"
        ),
        default_namespace=namespace,
        proxy=proxy,
    )


def load_kubeconfig(
    path: Path | None = None,
    context: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> KubeConnection:
    """Connect using a kubeconfig.

    *path* is loaded alone when given; otherwise the files listed in
    ``KUBECONFIG`` are merged (missing ones skipped, the first definition of a
    name wins), otherwise ``~/.kube/config`` is used. *context* defaults to the
    ``current-context``.
    """
    if path is not None:
        files = [path]
        if not path.is_file():
            raise KubeConfigError(f"kubeconfig {path} does not exist or is not a file")
    elif listed := _kubeconfig_env(environ):
        files = [p for p in listed if p.is_file()]
        if not files:
            shown = os.pathsep.join(str(p) for p in listed)
            raise KubeConfigError(f"none of the files in KUBECONFIG exist: {shown}")
    else:
        home_config = _home_kubeconfig(environ)
        if home_config is None or not home_config.is_file():
            raise KubeConfigError(
                f"no kubeconfig: KUBECONFIG is not set and {home_config} is missing"
            )
        files = [home_config]
    return _connect(_merge([_parse_file(f) for f in files]), context, environ)


def discover(
    kubeconfig: Path | None = None,
    context: str | None = None,
    environ: Mapping[str, str] = os.environ,
    *,
    in_cluster_root: Path = SERVICE_ACCOUNT_ROOT,
) -> KubeConnection | None:
    """Find the cluster the way the command line asks for it.

    In order: an explicit *kubeconfig*; in-cluster when
    ``KUBERNETES_SERVICE_HOST`` is set (unless a *context* was named, which
    only makes sense for a kubeconfig); ``KUBECONFIG`` when set (its files
    must exist: a typo there must not silently fall back to the demo cluster);
    ``~/.kube/config`` when present. None means no cluster is configured.
    """
    if kubeconfig is not None:
        return load_kubeconfig(kubeconfig, context, environ)
    if context is None and environ.get("KUBERNETES_SERVICE_HOST", "").strip():
        return load_in_cluster(environ, in_cluster_root)
    if _kubeconfig_env(environ):
        return load_kubeconfig(None, context, environ)
    home_config = _home_kubeconfig(environ)
    if home_config is not None and home_config.is_file():
        return load_kubeconfig(home_config, context, environ)
    if context is not None:
        raise KubeConfigError(f"context {context!r} was given but no kubeconfig was found")
    return None


# --- kubeconfig parsing ------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """A named cluster, user or context, with the file that defined it."""

    body: Mapping[str, Any]
    source: Path

    def where(self, kind: str, name: str) -> str:
        return f"{kind} {name!r} in kubeconfig {self.source}"

    def resolve(self, value: str) -> Path:
        # kubectl resolves relative paths against the defining file's directory.
        p = Path(value)
        return p if p.is_absolute() else self.source.parent / p


@dataclass
class _Config:
    sources: list[Path]
    clusters: dict[str, _Entry]
    users: dict[str, _Entry]
    contexts: dict[str, _Entry]
    current_context: str | None


def _kubeconfig_env(environ: Mapping[str, str]) -> list[Path]:
    return [Path(p) for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p.strip()]


def _home_kubeconfig(environ: Mapping[str, str]) -> Path | None:
    home = environ.get("HOME")
    if not home:
        try:
            return Path.home() / ".kube" / "config"
        except RuntimeError:
            return None
    return Path(home) / ".kube" / "config"


_NOT_JSON = object()


def _as_json(text: str) -> Any:
    """The document, when the kubeconfig is JSON (kubectl reads those too, and JSON
    is YAML): no PyYAML to import (0.8 MB). `_NOT_JSON` otherwise."""
    if not text.lstrip().startswith("{"):
        return _NOT_JSON
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a YAML flow mapping, or broken: PyYAML decides
        return _NOT_JSON


def _as_yaml(path: Path, text: str) -> Any:
    import yaml  # not for a JSON kubeconfig, and an in-cluster server never loads PyYAML

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Only the position and the generic problem: PyYAML's full message
        # quotes the offending line, which may be a token.
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise KubeConfigError(f"kubeconfig {path} is not valid YAML{at}: {problem}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise KubeConfigError(f"kubeconfig {path} is nested too deeply") from None


def _parse_file(path: Path) -> _Config:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {_os_reason(exc)}") from None
    doc = _as_json(text)
    if doc is _NOT_JSON:
        doc = _as_yaml(path, text)
    if doc is None:
        doc = {}  # an empty file is an empty config, as for kubectl
    if not isinstance(doc, dict):
        raise KubeConfigError(f"kubeconfig {path} is not a YAML mapping")
    current = doc.get("current-context")
    if current is not None and not isinstance(current, str):
        raise KubeConfigError(f"kubeconfig {path}: current-context is not a string")
    return _Config(
        sources=[path],
        clusters=_named_section(doc, path, "clusters", "cluster"),
        users=_named_section(doc, path, "users", "user"),
        contexts=_named_section(doc, path, "contexts", "context"),
        current_context=current or None,
    )


def _named_section(doc: Mapping[str, Any], path: Path, section: str, key: str) -> dict[str, _Entry]:
    items = doc.get(section)
    if items is None:
        return {}
    if not isinstance(items, list):
        raise KubeConfigError(f"kubeconfig {path}: {section} is not a list")
    out: dict[str, _Entry] = {}
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            raise KubeConfigError(f"kubeconfig {path}: {section}[{i}] has no name")
        body = item.get(key)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise KubeConfigError(
                f"kubeconfig {path}: {section}[{i}] ({name!r}) has no {key} mapping"
            )
        out.setdefault(name, _Entry(body, path))
    return out


def _merge(configs: list[_Config]) -> _Config:
    merged = _Config([], {}, {}, {}, None)
    for cfg in configs:
        merged.sources += cfg.sources
        # As with kubectl: the first file to define a name or current-context wins.
        for mine, theirs in (
            (merged.clusters, cfg.clusters),
            (merged.users, cfg.users),
            (merged.contexts, cfg.contexts),
        ):
            for name, entry in theirs.items():
                mine.setdefault(name, entry)
        merged.current_context = merged.current_context or cfg.current_context
    return merged


def _connect(cfg: _Config, context_name: str | None, environ: Mapping[str, str]) -> KubeConnection:
    shown = os.pathsep.join(str(s) for s in cfg.sources)
    if context_name is None:
        context_name = cfg.current_context
        if context_name is None:
            raise KubeConfigError(f"kubeconfig {shown} has no current-context and none was given")
    ctx = cfg.contexts.get(context_name)
    if ctx is None:
        known = ", ".join(sorted(cfg.contexts)) or "none"
        raise KubeConfigError(
            f"context {context_name!r} not found in kubeconfig {shown} (available: {known})"
        )
    ctx_where = ctx.where("context", context_name)

    cluster_name = _opt_str(ctx, "cluster", ctx_where)
    if not cluster_name:
        raise KubeConfigError(f"{ctx_where} names no cluster")
    cluster = cfg.clusters.get(cluster_name)
    if cluster is None:
        raise KubeConfigError(f"cluster {cluster_name!r} of {ctx_where} is not defined")
    cluster_where = cluster.where("cluster", cluster_name)

    user_name = _opt_str(ctx, "user", ctx_where)
    user: _Entry | None = None
    if user_name:  # no user: anonymous access, e.g. through `kubectl proxy`
        user = cfg.users.get(user_name)
        if user is None:
            raise KubeConfigError(f"user {user_name!r} of {ctx_where} is not defined")

    base_url = _server_url(cluster, cluster_where)
    tls = _cluster_tls(
        cluster,
        cluster_where,
        https=base_url.startswith("https:"),
        client_certificate=user is not None and _has_client_cert(user),
    )
    proxy = _proxy_url(cluster, cluster_where)
    credentials = _Credentials(None, None, "no credentials")
    if user is not None and user_name:
        credentials = _user_credentials(
            user,
            user.where("user", user_name),
            tls.context,
            partial(_exec_cluster, cluster, cluster_where, tls, proxy),
        )
    proxy, proxy_note = _proxy_choice(proxy, base_url, environ)

    return KubeConnection(
        base_url=base_url,
        verify=tls.context,
        token_source=credentials.tokens,
        description=(
            f"kubeconfig {ctx.source} context {context_name!r} "
            f"(server {base_url}{tls.note}{proxy_note}, {credentials.description})"
        ),
        default_namespace=_opt_str(ctx, "namespace", ctx_where),
        proxy=proxy,
        exec_credentials=credentials.exec_credentials,
    )


def _server_url(cluster: _Entry, where: str) -> str:
    server = _opt_str(cluster, "server", where)
    if not server:
        raise KubeConfigError(f"{where} has no server")
    parts = urlsplit(server.strip())
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise KubeConfigError(f"{where}: server is not an http(s) URL")
    if parts.username is not None or parts.password is not None:
        # Refused rather than stripped: the description would otherwise have
        # to be scrubbed, and kubectl does not use URL credentials either.
        raise KubeConfigError(f"{where}: server URL must not contain credentials")
    try:
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise KubeConfigError(f"{where}: server URL has an invalid port") from None
    # Keep any path (API servers behind a proxy live under a prefix).
    return f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")


@dataclass(frozen=True)
class _ClusterTls:
    # None for a plain-http server with no TLS setting at all.
    context: ssl.SSLContext | None
    #: For the connection's description: ", TLS verification disabled", ...
    note: str
    ca_pem: bytes | None
    insecure: bool
    server_name: str | None


def _cluster_tls(
    cluster: _Entry, where: str, *, https: bool, client_certificate: bool
) -> _ClusterTls:
    insecure = cluster.body.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise KubeConfigError(f"{where}: insecure-skip-tls-verify is not true or false")
    server_name = _opt_str(cluster, "tls-server-name", where)

    ca_pem: bytes | None = None
    ca_label = ""
    ca_data = _opt_str(cluster, "certificate-authority-data", where)
    ca_file = _opt_str(cluster, "certificate-authority", where)
    if ca_data:  # like kubectl, the -data form overrides the file
        ca_label = f"certificate-authority-data of {where}"
        ca_pem = _b64(ca_data, ca_label)
    elif ca_file:
        ca_path = cluster.resolve(ca_file)
        ca_label = f"certificate-authority {ca_path} of {where}"
        ca_pem = _read_file(ca_path, f"certificate-authority of {where}")

    if insecure and ca_pem is not None:
        # kubectl refuses this combination too: the user must pick one.
        raise KubeConfigError(
            f"{where} sets both insecure-skip-tls-verify and a certificate authority"
        )

    if not (https or insecure or ca_pem or server_name or client_certificate):
        # A plain-http server (`kubectl proxy`, an emulator): no SSLContext at all,
        # about 0.5 MB of OpenSSL's memory that would never be used.
        return _ClusterTls(None, "", None, False, None)
    context = _new_context(server_name)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return _ClusterTls(context, ", TLS verification disabled", None, True, server_name)
    if ca_pem is not None:
        _load_ca(context, ca_pem, ca_label)
    elif https:
        context.load_default_certs()  # no CA configured: the system roots, as kubectl does
    # (A plain-http server never has its certificate checked: the system roots,
    # about 1.3 MB of OpenSSL memory, would only sit in an unused context.)
    note = f", TLS server name {server_name}" if server_name else ""
    return _ClusterTls(context, note, ca_pem, False, server_name)


_PROXY_SCHEMES = ("http", "https")


def _proxy_url(cluster: _Entry, where: str) -> str | None:
    """The cluster's ``proxy-url``, checked; httpx sends every request through it."""
    raw = _opt_str(cluster, "proxy-url", where)
    if raw is None or not raw.strip():
        return None
    parts = urlsplit(raw.strip())
    scheme = parts.scheme.lower()
    if scheme.startswith("socks"):
        raise KubeConfigError(
            f"{where}: proxy-url uses {scheme}, which jobsignal does not support "
            "(http and https proxies are)"
        )
    if scheme not in _PROXY_SCHEMES or not parts.hostname:
        raise KubeConfigError(f"{where}: proxy-url is not an http(s) URL")
    try:
        _ = parts.port
    except ValueError:
        raise KubeConfigError(f"{where}: proxy-url has an invalid port") from None
    return raw.strip()


def _proxy_choice(
    explicit: str | None, base_url: str, environ: Mapping[str, str]
) -> tuple[str | None, str]:
    """The proxy for `base_url` (the cluster's ``proxy-url``, else the environment's)
    and the words that say so in a connection's description."""
    if explicit is not None:
        return explicit, f", via proxy {_redact_url(explicit)}"
    try:
        found = proxy_for(base_url, environ)
    except ProxyConfigError as error:
        raise KubeConfigError(str(error)) from None
    if found is None:
        return None, ""
    return found.url, f", via proxy {_redact_url(found.url)} ({found.variable})"


def _redact_url(url: str) -> str:
    """*url* without user, password, path or query: safe for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}"


def _exec_cluster(
    cluster: _Entry, where: str, tls: _ClusterTls, proxy: str | None
) -> dict[str, Any]:
    """``spec.cluster`` of KUBERNETES_EXEC_INFO, for plugins with provideClusterInfo."""
    info: dict[str, Any] = {"server": (_opt_str(cluster, "server", where) or "").strip()}
    if tls.server_name:
        info["tls-server-name"] = tls.server_name
    if tls.insecure:
        info["insecure-skip-tls-verify"] = True
    if tls.ca_pem is not None:
        # A []byte field in client-go's JSON: base64, also when the CA came from a file.
        info["certificate-authority-data"] = base64.b64encode(tls.ca_pem).decode("ascii")
    if proxy:
        info["proxy-url"] = proxy
    if cluster.body.get("disable-compression") is True:
        info["disable-compression"] = True
    extensions = cluster.body.get("extensions")
    if extensions is not None:
        if not isinstance(extensions, list):
            raise KubeConfigError(f"{where}: extensions is not a list")
        for extension in extensions:
            # The extension reserved for exec plugins carries per-cluster plugin settings.
            if isinstance(extension, dict) and extension.get("name") == _EXEC_EXTENSION:
                if extension.get("extension") is not None:
                    info["config"] = extension["extension"]
                break
    return info


_EXEC_EXTENSION = "client.authentication.k8s.io/exec"


@dataclass(frozen=True)
class _Credentials:
    """What a kubeconfig user authenticates with (a client certificate lives in the context)."""

    tokens: TokenSource | None
    exec_credentials: ExecCredentials | None
    description: str


_IMPERSONATION = ("as", "as-uid", "as-groups", "as-user-extra")
_INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")


def _user_credentials(
    user: _Entry,
    where: str,
    context: ssl.SSLContext | None,
    exec_cluster: Callable[[], dict[str, Any]],
) -> _Credentials:
    if user.body.get("auth-provider"):
        raise KubeConfigError(
            f"{where} uses an auth-provider plugin, which jobsignal does not support; "
            "use an exec plugin, a token, tokenFile or client certificate"
        )
    if user.body.get("username") or user.body.get("password"):
        raise KubeConfigError(
            f"{where} uses basic auth (username/password), which is not supported"
        )
    if impersonation := [key for key in _IMPERSONATION if user.body.get(key)]:
        # Refused, not ignored: requests would silently run with other permissions.
        raise KubeConfigError(
            f"{where} sets {', '.join(impersonation)} (impersonation), which jobsignal does "
            "not support; grant the permissions to the user itself and remove the field"
        )

    token_file = _opt_str(user, "tokenFile", where)
    token = _opt_str(user, "token", where)
    exec_body = user.body.get("exec")
    if exec_body:
        static = [
            name
            for name, present in (
                ("tokenFile", bool(token_file)),
                ("token", bool(token and token.strip())),
                ("a client certificate", _has_client_cert(user)),
            )
            if present
        ]
        if static:
            raise KubeConfigError(
                f"{where} sets both exec and {' and '.join(static)}; keep only one way "
                "to authenticate"
            )
        # Imported here: a kubeconfig without an exec user needs none of the runner.
        from jobsignal.kube.exec_credentials import ExecCredentials

        plugin = ExecCredentials(_exec_plugin(user, exec_body, where, exec_cluster))
        return _Credentials(None, plugin, plugin.description)

    notes: list[str] = []
    tokens: TokenSource | None = None
    if token_file:
        # client-go: when both are set, the file's contents take precedence.
        tokens = TokenSource.from_file(user.resolve(token_file))
    elif token and token.strip():
        tokens = TokenSource.fixed(token.strip())
    if tokens is not None:
        notes.append(tokens.description)

    cert = _pem_source(user, "client-certificate", where)
    key = _pem_source(user, "client-key", where)
    if (cert is None) != (key is None):
        missing = "client-key" if key is None else "client-certificate"
        raise KubeConfigError(f"{where} has a client certificate or key but no {missing}")
    if cert is not None and key is not None:
        if context is None:  # `_cluster_tls` builds one wherever a client certificate is set
            raise RuntimeError("a client certificate without an SSLContext")
        _load_client_cert(context, cert, key, where)
        notes.append("client certificate")
    return _Credentials(tokens, None, ", ".join(notes) or "no credentials")


def _has_client_cert(user: _Entry) -> bool:
    return any(
        user.body.get(key)
        for key in (
            "client-certificate",
            "client-certificate-data",
            "client-key",
            "client-key-data",
        )
    )


def _exec_plugin(
    user: _Entry, body: object, where: str, exec_cluster: Callable[[], dict[str, Any]]
) -> ExecPlugin:
    """The user's ``exec`` stanza, checked the way client-go reads it."""
    if not isinstance(body, dict):
        raise KubeConfigError(f"{where}: exec is not a mapping")
    command = body.get("command")
    if not isinstance(command, str) or not command.strip():
        raise KubeConfigError(f"{where}: exec has no command")
    command = command.strip()
    label = f"exec plugin {command!r} of {where}"
    supported = " or ".join(API_VERSIONS)
    api_version = body.get("apiVersion")
    if not api_version:
        raise KubeConfigError(f"{label} has no apiVersion (use {supported})")
    if api_version not in API_VERSIONS:
        raise KubeConfigError(
            f"{label}: apiVersion {quote(api_version)} is not supported (use {supported})"
        )
    args = body.get("args")
    if args is None:
        args = []
    if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
        raise KubeConfigError(f"{label}: args is not a list of strings")
    mode = body.get("interactiveMode")
    # Missing means IfAvailable, as for v1beta1; with no terminal it behaves like Never.
    if mode is not None and mode not in _INTERACTIVE_MODES:
        raise KubeConfigError(
            f"{label}: interactiveMode {quote(mode)} is not Never, IfAvailable or Always"
        )
    if mode == "Always":
        raise KubeConfigError(
            f"{label} has interactiveMode Always, but jobsignal runs without a terminal "
            "(no standard input); configure the plugin to work without a prompt "
            "(interactiveMode Never or IfAvailable)"
        )
    provide_cluster_info = body.get("provideClusterInfo", False)
    if not isinstance(provide_cluster_info, bool):
        raise KubeConfigError(f"{label}: provideClusterInfo is not true or false")
    hint = body.get("installHint")
    if hint is not None and not isinstance(hint, str):
        raise KubeConfigError(f"{label}: installHint is not a string")
    if os.sep in command and not os.path.isabs(command):
        # client-go resolves a relative path (not a bare name) against the kubeconfig.
        command = str(user.resolve(command))
    return ExecPlugin(
        command=command,
        args=tuple(args),
        env=_exec_env(body.get("env"), label),
        api_version=api_version,
        exec_info=exec_info(api_version, exec_cluster() if provide_cluster_info else None),
        label=label,
        install_hint=hint or None,
    )


def _exec_env(env: object, label: str) -> tuple[tuple[str, str], ...]:
    if env is None:
        return ()
    if not isinstance(env, list):
        raise KubeConfigError(f"{label}: env is not a list of name/value pairs")
    pairs: list[tuple[str, str]] = []
    for i, item in enumerate(env):
        name = item.get("name") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        # Values are not quoted back: plugins take secrets through env.
        if not isinstance(name, str) or not name or "=" in name or not isinstance(value, str):
            raise KubeConfigError(f"{label}: env[{i}] needs a name and a string value")
        pairs.append((name, value))
    return tuple(pairs)


def load_client_certificate(
    context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes, label: str
) -> None:
    """Load a PEM client certificate and key into *context* (replacing any before).

    For credentials that arrive at run time (exec plugins); errors name *label*.
    """
    _load_client_cert(
        context,
        _Pem(cert_pem, None, f"client certificate from {label}"),
        _Pem(key_pem, None, f"client key from {label}"),
        label,
    )


@dataclass(frozen=True)
class _Pem:
    """A client certificate or key: its bytes, and its file when it has one."""

    data: bytes
    path: Path | None
    label: str


def _pem_source(user: _Entry, field: str, where: str) -> _Pem | None:
    """*field* from ``<field>-data`` (which wins, as in kubectl) or from its file."""
    data = _opt_str(user, f"{field}-data", where)
    if data:
        label = f"{field}-data of {where}"
        return _Pem(_b64(data, label), None, label)
    file = _opt_str(user, field, where)
    if file:
        path = user.resolve(file)
        # Read up front so a missing or non-PEM file is reported by name, not
        # as an anonymous OpenSSL error from load_cert_chain.
        return _Pem(_read_file(path, f"{field} of {where}"), path, f"{field} {path} of {where}")
    return None


def _load_client_cert(context: ssl.SSLContext, cert: _Pem, key: _Pem, where: str) -> None:
    if b"-----BEGIN CERTIFICATE-----" not in cert.data:
        raise KubeConfigError(f"{cert.label} is not a PEM certificate")
    if b"PRIVATE KEY-----" not in key.data:
        raise KubeConfigError(f"{key.label} is not a PEM private key")

    def no_password() -> str:
        # Without a callback OpenSSL would prompt on the terminal for an
        # encrypted key, which hangs a sidecar.
        raise _EncryptedKeyError

    with ExitStack() as stack:
        # Files are loaded in place; only -data needs a temporary file.
        cert_path = cert.path or stack.enter_context(_private_file(cert.data))
        key_path = key.path or stack.enter_context(_private_file(key.data))
        try:
            context.load_cert_chain(cert_path, key_path, password=no_password)
        except _EncryptedKeyError:
            raise KubeConfigError(
                f"{key.label} is encrypted; jobsignal needs an unencrypted key"
            ) from None
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise KubeConfigError(
                    f"client certificate and key of {where} do not match"
                ) from None
            reason = exc.reason or "unreadable"
            raise KubeConfigError(
                f"client certificate or key of {where} is not valid PEM ({reason})"
            ) from None
        except OSError as exc:
            raise KubeConfigError(
                f"cannot load client certificate of {where}: {_os_reason(exc)}"
            ) from None


class _EncryptedKeyError(Exception):
    pass


@contextmanager
def _private_file(data: bytes) -> Iterator[Path]:
    """*data* in a file only this user can read, deleted on exit.

    ``SSLContext.load_cert_chain`` accepts only file names, so ``-data`` keys
    must touch the file system for the moment it takes to load them.
    """
    with tempfile.TemporaryDirectory(prefix="jobsignal-tls-") as tmp:  # mode 0700
        path = Path(tmp) / "pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path


# --- TLS helpers ---------------------------------------------------------------


class _ServerNameContext(ssl.SSLContext):
    """An SSLContext that checks (and sends as SNI) a fixed server name.

    This is kubeconfig's ``tls-server-name``: the API server is reached by
    address but its certificate names something else. httpx only exposes this
    per request (the ``sni_hostname`` extension); overriding the name here makes
    ``verify=conn.verify`` enough. httpx's async backends use ``wrap_bio``, its
    sync backend ``wrap_socket``.
    """

    server_name: str

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        name = server_hostname if server_side else self.server_name
        return super().wrap_bio(incoming, outgoing, server_side, name, session)

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        name = server_hostname if server_side else self.server_name
        return super().wrap_socket(
            sock, server_side, do_handshake_on_connect, suppress_ragged_eofs, name, session
        )


def _new_context(server_name: str | None = None) -> ssl.SSLContext:
    # PROTOCOL_TLS_CLIENT already means CERT_REQUIRED and check_hostname=True.
    context: ssl.SSLContext
    if server_name:
        named = _ServerNameContext(ssl.PROTOCOL_TLS_CLIENT)
        named.server_name = server_name
        context = named
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _load_ca(context: ssl.SSLContext, pem: bytes, label: str) -> None:
    try:
        text = pem.decode("ascii")
    except UnicodeDecodeError:
        raise KubeConfigError(f"{label} is not PEM text") from None
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise KubeConfigError(f"{label} holds no PEM certificate")
    try:
        context.load_verify_locations(cadata=text)
    except ssl.SSLError as exc:
        raise KubeConfigError(
            f"{label} is not a valid PEM certificate ({exc.reason or 'unreadable'})"
        ) from None


# --- small helpers -----------------------------------------------------------


def _opt_str(entry: _Entry, key: str, where: str) -> str | None:
    value = entry.body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise KubeConfigError(f"{where}: {key} is not a string")
    return value


def _b64(data: str, label: str) -> bytes:
    try:
        # Whitespace is tolerated: hand-edited files wrap long lines.
        decoded = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise KubeConfigError(f"{label} is not valid base64") from None
    if not decoded:
        raise KubeConfigError(f"{label} is empty")
    return decoded


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KubeConfigError(f"cannot read {path} ({what}): {_os_reason(exc)}") from None


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    return type(exc).__name__
