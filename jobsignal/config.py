"""Settings of `jobsignal serve`: each declared once, as a field of `Config` carrying its
flag, env var, default, check, help and --help group, and the kind of value it takes
(SECONDS, BYTES, HOST:PORT: named after the parser that checks it). SERVE_SETTINGS, the
command line, the README table and `DEFAULTS` come from there. Each layer's settings
are a `LayerSettings` dataclass whose fields name what they read (`from_setting`), which
gives both their defaults and `from_config`; the layers keep no default of their own.

Precedence: command-line flag, then environment variable, then default. A bad
value raises `ConfigError` with one line naming the setting, where it came
from and what is accepted; the CLI prints it and exits with status 2.
`SUBSCRIBE_SETTINGS` are the TLS settings of `jobsignal subscribe`, read the same way,
and `TARGET_SETTING` the server the client commands ask (`--target`, `JOBSIGNAL_TARGET`).
This module imports no other part of jobsignal: every layer may import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar, cast


class ConfigError(Exception):
    """A setting has a bad value; the message is one line for the user."""


def cannot_listen(setting: str, host: str, port: int, error: OSError) -> ConfigError:
    """A listen address this host cannot listen on (in use, not its own, unknown)."""
    # asyncio rewrites a bind error's text, errno still names it; a name that does
    # not resolve has a negative errno (getaddrinfo's) and a text of its own.
    known = error.errno is not None and error.errno > 0
    reason = os.strerror(error.errno or 0) if known else (error.strerror or str(error))
    return ConfigError(f"{setting} {show_address(host, port)}: cannot listen there: {reason}")


def _positive_float(text: str, unit: str = "of seconds") -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"must be a positive number {unit}")
    return value


def _per_second(text: str) -> float:
    return _positive_float(text, "per second")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError("must be zero or a positive number of seconds")
    return value


def _optional_positive_float(text: str) -> float | None:
    """Seconds, or empty for none."""
    return _positive_float(text) if text else None


def _optional_non_negative_float(text: str) -> float | None:
    """Seconds (zero included), or empty for none."""
    return _non_negative_float(text) if text else None


def _positive_int(text: str, what: str = "integer") -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"must be a positive {what}")
    return value


def _bytes(text: str) -> int:
    return _positive_int(text, "number of bytes")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"{name!r} is not a valid name")
    return names


class _Choice:
    """Parses one word of `choices`; with `any_case`, INFO and Info are info."""

    def __init__(self, choices: tuple[str, ...], any_case: bool) -> None:
        self.choices = choices
        self.any_case = any_case

    def __call__(self, text: str) -> str:
        word = text.lower() if self.any_case else text
        if word not in self.choices:
            case = " (in any case)" if self.any_case else ""
            raise ValueError(f"must be one of {', '.join(self.choices)}{case}")
        return word


def _choice(*choices: str, any_case: bool = False) -> _Choice:
    return _Choice(choices, any_case)


def parse_listen(text: str, *, any_host: bool = False) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT; with `any_host`, also :PORT (host "": every address)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not (host or any_host):
        raise ValueError("must be HOST:PORT, for example 0.0.0.0:8899")
    host = host.removeprefix("[").removesuffix("]")
    port = int(port_text) if port_text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise ValueError("port must be between 0 and 65535")
    return host, port


def show_address(host: str, port: int) -> str:
    """HOST:PORT as `parse_listen` reads it back: [::]:8899 for an IPv6 host, :8899 for ""."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_listen_list(text: str) -> tuple[tuple[str, int], ...]:
    """Comma-separated HOST:PORT, [IPv6]:PORT or :PORT (every address of the host,
    IPv4 and IPv6 where it has both)."""
    addresses = tuple(parse_listen(item.strip(), any_host=True) for item in text.split(","))
    if len(set(addresses)) != len(addresses):
        raise ValueError("lists an address twice")
    return addresses


def _optional_listen(text: str) -> tuple[str, int] | None:
    return parse_listen(text) if text else None


def _text(text: str) -> str:
    return text


def _name(text: str) -> str:
    if _names(text) != (text,):
        raise ValueError("must be one name")
    return text


def _path(text: str) -> str:
    return text


# What --help shows as the value of a setting, by the parser that checks it.
_VALUE_NAMES: dict[Callable[[str], Any], str] = {
    parse_listen: "HOST:PORT",
    parse_listen_list: "HOST:PORT,...",
    _optional_listen: "HOST:PORT",
    _positive_float: "SECONDS",
    _non_negative_float: "SECONDS",
    _optional_positive_float: "SECONDS",
    _optional_non_negative_float: "SECONDS",
    _per_second: "PER_SECOND",
    _positive_int: "COUNT",
    _bytes: "BYTES",
    _names: "NAME,...",
    _path: "FILE",
    _text: "TEXT",
    _name: "NAME",
}


@dataclass(frozen=True)
class Setting:
    """One setting: its flag and env var come from `name`; `group` is its --help
    section, and `metavar`, when set, overrides the value name derived from `parse`."""

    name: str
    default: str
    parse: Callable[[str], Any]
    help: str
    env_prefix: str = "JOBSIGNAL_"
    metavar: str = ""
    group: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.env_prefix + self.name.upper()

    @property
    def value_name(self) -> str:
        """SECONDS, BYTES, HOST:PORT, {text,json}...: the kind of value the flag takes."""
        if self.metavar:
            return self.metavar
        if isinstance(self.parse, _Choice):
            return "{" + ",".join(self.parse.choices) + "}"
        return _VALUE_NAMES.get(self.parse, "VALUE")

    @property
    def choices(self) -> tuple[str, ...]:
        """The words a choice setting takes (for shell completion); () for the others."""
        return self.parse.choices if isinstance(self.parse, _Choice) else ()


_SETTING = "jobsignal.setting"
_T = TypeVar("_T")


def setting(
    default: str, parse: Callable[[str], _T], help: str, *, group: str, metavar: str = ""
) -> _T:
    """A Config field that declares its setting: the default (as the command line
    would spell it), the parser that checks it, its help and its --help group.

    Typed as what `parse` returns, so mypy checks the parser against the
    field's annotation; the field itself has no default (`load_config` gives
    every one).
    """
    declared = Setting("", default, parse, help, metavar=metavar, group=group)
    return cast(_T, dataclasses.field(metadata={_SETTING: declared}))


@dataclass(frozen=True)
class Config:
    """Every `serve` setting, validated, built by `load_config` (flags, environment,
    defaults) or `configure` (keywords, defaults).

    Each field is the one declaration of its setting (`setting(...)`): name,
    flag, env var, type, default, help and --help group. SERVE_SETTINGS, the
    command line, the README table and the layers' defaults (`DEFAULTS`) are
    all derived from it, in this order; a --help group is listed where its
    first setting is, and a title that comes back shows its flags together.
    """

    listen: tuple[tuple[str, int], ...] = setting(
        ":8899",
        parse_listen_list,
        "gRPC listen addresses, comma-separated HOST:PORT, [IPv6]:PORT or :PORT (every"
        " address: IPv4 and IPv6 where the host has both)",
        group="gRPC",
    )
    tls_cert: str = setting("", _path, "PEM certificate chain: serve gRPC over TLS", group="TLS")
    tls_key: str = setting("", _path, "PEM private key of --tls-cert", group="TLS")
    tls_client_ca: str = setting(
        "",
        _path,
        "PEM CA bundle: require client certificates signed by it (mutual TLS)",
        group="TLS",
    )
    tls_reload_interval: float = setting(
        "30",
        _positive_float,
        "seconds between checks of the TLS files; changed files are reloaded live",
        group="TLS",
    )
    metrics_listen: tuple[str, int] | None = setting(
        "",
        _optional_listen,
        "plain-HTTP HOST:PORT serving /metrics, /readyz, /livez, /healthz, and who is"
        " subscribed: / (a page) and /debug/subscriptions (JSON) (empty: off)",
        group="metrics",
    )
    source: str = setting(
        "auto",
        _choice("auto", "kubernetes", "demo", "relay"),
        "where jobs come from: kubernetes (ConfigMaps, in-cluster or kubeconfig), demo"
        " (embedded emulated cluster), relay (another job.Job server: --upstream), or auto"
        " (kubernetes when configured, else demo)",
        group="Kubernetes",
    )
    kubeconfig: str = setting(
        "", _path, "kubeconfig file (default: KUBECONFIG, ~/.kube/config)", group="Kubernetes"
    )
    context: str = setting(
        "",
        _text,
        "kubeconfig context (default: current-context)",
        metavar="NAME",
        group="Kubernetes",
    )
    namespaces: tuple[str, ...] = setting(
        "", _names, "namespaces to watch, comma-separated (default: all)", group="Kubernetes"
    )
    label_selector: str = setting(
        "outside-job-info=true",
        _text,
        "label selector of job ConfigMaps",
        metavar="SELECTOR",
        group="Kubernetes",
    )
    watch_timeout: float = setting(
        "300", _positive_float, "timeoutSeconds asked of each WATCH", group="Kubernetes"
    )
    read_timeout: float = setting(
        "90",
        _positive_float,
        "restart a WATCH silent for this long (above the ~60 s bookmark interval)",
        group="Kubernetes",
    )
    upstream: tuple[str, int] | None = setting(
        "",
        _optional_listen,
        "the job.Job server --source relay subscribes to (ClusterD or another jobsignal)",
        group="relay",
    )
    upstream_role: str = setting(
        "DefaultUser2",
        _name,
        "role the relay registers with upstream",
        metavar="ROLE",
        group="relay",
    )
    upstream_tls_ca: str = setting(
        "",
        _path,
        "PEM CA bundle verifying the upstream: connect over TLS ('system': the system's"
        " trust store)",
        group="relay",
    )
    upstream_tls_cert: str = setting(
        "",
        _path,
        "PEM client certificate chain for mutual TLS with the upstream (needs --upstream-tls-ca)",
        group="relay",
    )
    upstream_tls_key: str = setting(
        "", _path, "PEM private key of --upstream-tls-cert", group="relay"
    )
    upstream_tls_server_name: str = setting(
        "",
        _text,
        "name the upstream's certificate must carry (default: the --upstream host)",
        metavar="NAME",
        group="relay",
    )
    upstream_grace: float = setting(
        "30",
        _positive_float,
        "seconds the upstream may be lost (its last state still served) before health"
        " turns NOT_SERVING",
        group="relay",
    )
    upstream_max_message_bytes: int = setting(
        "16777216",
        _bytes,
        "largest message taken from the upstream; a bigger one ends the connection",
        group="relay",
    )
    idle_timeout: float = setting(
        "120",
        _positive_float,
        "close a stream with no message and no client heartbeat (its PING, or its ACK of the"
        " server's keepalive PING) for this long (seconds)",
        group="gRPC",
    )
    roles: tuple[str, ...] = setting(
        "CCAgent,DefaultUser1,DefaultUser2,FdAgent",
        _names,
        "roles allowed to Register, comma-separated",
        metavar="ROLE,...",
        group="gRPC",
    )
    snapshot_roles: tuple[str, ...] = setting(
        "FdAgent",
        _names,
        "roles whose SubscribeJobSummarySignal starts with the current state of every job",
        metavar="ROLE,...",
        group="gRPC",
    )
    max_subscriptions_per_role: int = setting(
        "20", _positive_int, "active subscriptions per role", group="limits"
    )
    max_subscriptions_per_role_per_ip: int = setting(
        "10",
        _positive_int,
        "active subscriptions of one role held by one client address (keep it below"
        " --max-subscriptions-per-role, or one address can take all of a role's slots)",
        group="limits",
    )
    max_registrations: int = setting(
        "1024", _positive_int, "registered client ids held at once", group="limits"
    )
    max_registrations_per_ip: int = setting(
        "128",
        _positive_int,
        "registered ids not yet subscribed held by one client address (keep it below"
        " --max-registrations, or one address can fill the registry)",
        group="limits",
    )
    registration_ttl: float = setting(
        "300",
        _positive_float,
        "seconds a registered id may wait for its subscription before it expires",
        group="limits",
    )
    max_pending_messages: int = setting(
        "1024",
        _positive_int,
        "messages queued per subscriber (after coalescing per job) before it is"
        " disconnected with RESOURCE_EXHAUSTED",
        group="limits",
    )
    max_pending_bytes: int = setting(
        "67108864", _bytes, "bytes queued per subscriber before it is disconnected", group="limits"
    )
    send_timeout: float = setting(
        "60",
        _positive_float,
        "a write blocked this long (client not reading) disconnects the client",
        group="limits",
    )
    keepalive_time: float = setting(
        "60",
        _positive_float,
        "seconds without a heartbeat from a peer after which the server PINGs it (below"
        " --idle-timeout): the ACK keeps quiet streams open, no answer finds dead peers",
        group="keepalive",
    )
    keepalive_timeout: float = setting(
        "5",
        _positive_float,
        "seconds after such a PING with nothing read (not even its ACK) before the connection is"
        " closed",
        group="keepalive",
    )
    min_client_ping_interval: float = setting(
        "3",
        _positive_float,
        "client PINGs while no data flows closer than this (less 10% for timer jitter) are"
        " strikes; 3 s is ClusterD v26's policy",
        group="keepalive",
    )
    ping_strikes: int = setting(
        "2",
        _positive_int,
        "strikes allowed before GOAWAY ENHANCE_YOUR_CALM too_many_pings",
        group="keepalive",
    )
    max_connection_age: float | None = setting(
        "",
        _optional_positive_float,
        "seconds (less or more 10%, at random) after which a connection gets GOAWAY, so its"
        " client opens new calls on a new connection, through the Service to any replica;"
        " its open streams go on (empty: never)",
        group="keepalive",
    )
    max_connection_age_grace: float | None = setting(
        "",
        _optional_non_negative_float,
        "seconds the open streams of such a connection then get before each subscription ends"
        " with UNAVAILABLE (reconnect) and the connection closes (empty: no limit, no stream"
        " is ended: a subscription moves only when it ends)",
        group="keepalive",
    )
    handshake_timeout: float = setting(
        "5",
        _positive_float,
        "seconds a new connection has to finish TLS and send the HTTP/2 preface and SETTINGS",
        group="HTTP/2 protection",
    )
    request_timeout: float = setting(
        "10",
        _positive_float,
        "seconds a client has to send a job.Job or health request once its stream is open;"
        " then DEADLINE_EXCEEDED",
        group="HTTP/2 protection",
    )
    max_stream_resets_per_second: float = setting(
        "100",
        _per_second,
        "RST_STREAM frames per second one client address may send over all its connections"
        " (bursts of twice as many) for streams opened in the last second or two; beyond:"
        " GOAWAY ENHANCE_YOUR_CALM rapid_reset",
        group="HTTP/2 protection",
    )
    max_control_frames_per_second: float = setting(
        "500",
        _per_second,
        "frames other than HEADERS and CONTINUATION (SETTINGS, PING, WINDOW_UPDATE, DATA, ...)"
        " per second one connection may send (bursts of twice as many, plus 2 per frame the"
        " server sends); beyond: GOAWAY ENHANCE_YOUR_CALM control_flood",
        group="HTTP/2 protection",
    )
    max_control_frames_per_second_per_ip: float = setting(
        "2000",
        _per_second,
        "the same frames per second one client address may send over all its connections,"
        " not counting those answering data the server sent nor each connection's own"
        " allowance (10 at once, for its handshake, then 1 a second) (bursts of twice as"
        " many); beyond: its connections' input waits its turn (nothing is closed)",
        group="HTTP/2 protection",
    )
    read_bytes_per_turn: int = setting(
        "16384",
        _bytes,
        "bytes of one connection's input handled per event-loop turn (fairness between peers)",
        group="HTTP/2 protection",
    )
    write_stall_timeout: float = setting(
        "30",
        _positive_float,
        "seconds a connection may leave the server unable to write (the peer does not read)"
        " before it is closed; meanwhile the server stops reading from it",
        group="HTTP/2 protection",
    )
    max_request_bytes: int = setting(
        "4096",
        _bytes,
        "largest request message accepted (a ClientInfo is under 300 bytes); what a"
        " request holds while it arrives",
        group="limits",
    )
    max_send_bytes: int = setting(
        "4194304",
        _bytes,
        "largest message sent; a bigger job event goes out with an empty HcclJson (the"
        " default is gRPC clients' default receive limit; raise both together)",
        group="limits",
    )
    max_connections: int = setting(
        "1024", _positive_int, "open connections in total", group="limits"
    )
    max_connections_per_ip: int = setting(
        "512", _positive_int, "open connections per client address", group="limits"
    )
    max_streams_per_connection: int = setting(
        "64", _positive_int, "concurrent RPCs on one connection", group="limits"
    )
    register_rate: float = setting(
        "100", _per_second, "Register calls per second per address", group="limits"
    )
    register_burst: int = setting(
        "200", _positive_int, "Register calls allowed in a burst", group="limits"
    )
    subscribe_rate: float = setting(
        "100", _per_second, "Subscribe calls per second per address", group="limits"
    )
    subscribe_burst: int = setting(
        "200", _positive_int, "Subscribe calls allowed in a burst", group="limits"
    )
    drain_delay: float = setting(
        "5",
        _non_negative_float,
        "on SIGTERM/SIGINT, seconds of health NOT_SERVING and /readyz 503 while live streams"
        " are still served, so load balancers stop sending new clients, before the shutdown",
        group="shutdown",
    )
    shutdown_grace: float = setting(
        "5", _positive_float, "seconds streams get to end on shutdown", group="shutdown"
    )
    log_level: str = setting(
        "info",
        _choice("debug", "info", "warning", "error", any_case=True),
        "log level",
        group="logging",
    )
    log_format: str = setting(
        "text", _choice("text", "json"), "log format: text or json lines", group="logging"
    )


# The settings of `jobsignal serve`, in declaration order.
SERVE_SETTINGS: tuple[Setting, ...] = tuple(
    dataclasses.replace(field.metadata[_SETTING], name=field.name)
    for field in dataclasses.fields(Config)
)


# `jobsignal subscribe`'s TLS; env vars JOBSIGNAL_SUBSCRIBE_*, apart from serve's own files.
_SUBSCRIBE_ENV = "JOBSIGNAL_SUBSCRIBE_"
SUBSCRIBE_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "tls_ca",
        "",
        _path,
        "PEM CA bundle verifying the server: connect over TLS ('system': the system's trust store)",
        _SUBSCRIBE_ENV,
        group="TLS",
    ),
    Setting(
        "tls_cert",
        "",
        _path,
        "PEM client certificate chain for mutual TLS (needs --tls-ca)",
        _SUBSCRIBE_ENV,
        group="TLS",
    ),
    Setting("tls_key", "", _path, "PEM private key of --tls-cert", _SUBSCRIBE_ENV, group="TLS"),
    Setting(
        "tls_server_name",
        "",
        _text,
        "name the server's certificate must carry (default: the --target host)",
        _SUBSCRIBE_ENV,
        metavar="NAME",
        group="TLS",
    ),
)


# The server a client command (subscribe, jobs, check) asks; no default: one of the
# two must be given.
# Where `serve` and `demo` listen by default, as a client on this host reaches them.
TARGET_SETTING = Setting(
    "target", "127.0.0.1:8899", parse_listen, "the jobsignal server to ask", metavar="HOST:PORT"
)


def add_arguments(parser: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    """A flag per setting, in --help groups, each naming the kind of value it takes."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting in settings:
        group = groups.get(setting.group)
        if group is None:
            group = groups[setting.group] = parser.add_argument_group(setting.group or "settings")
        group.add_argument(
            setting.flag,
            dest=setting.name,
            default=None,
            metavar=setting.value_name,
            # argparse expands %-formats in help texts: a literal % must be doubled.
            help=f"{setting.help} [env {setting.env}, default {setting.default!r}]".replace(
                "%", "%%"
            ),
        )


def resolve(
    settings: Sequence[Setting], flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for setting in settings:
        flag_value = flags.get(setting.name)
        if flag_value is not None:
            raw, origin = flag_value, setting.flag
        elif setting.env in environ:
            raw, origin = environ[setting.env], setting.env
        else:
            raw, origin = setting.default, "default"
        try:
            values[setting.name] = setting.parse(raw)
        except ValueError as error:
            raise ConfigError(f"{origin}={raw!r}: {error}") from None
    return values


def load_config(flags: Mapping[str, str | None], environ: Mapping[str, str]) -> Config:
    values = resolve(SERVE_SETTINGS, flags, environ)
    config = Config(**values)
    if config.read_timeout <= 60:
        raise ConfigError(
            f"read timeout {config.read_timeout:g}s must exceed the 60 s bookmark interval,"
            " or quiet watches restart needlessly"
        )
    if config.keepalive_time >= config.idle_timeout:
        raise ConfigError(
            f"--keepalive-time {config.keepalive_time:g}s must be below --idle-timeout"
            f" {config.idle_timeout:g}s: the server's keepalive PING is what gives a client"
            " without keepalive of its own a heartbeat before its quiet stream is idle"
        )
    if config.max_connection_age_grace is not None and config.max_connection_age is None:
        raise ConfigError(
            "--max-connection-age-grace needs --max-connection-age: without an age no"
            " connection is ever asked to go"
        )
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    _check_relay(config)
    unknown = set(config.snapshot_roles) - set(config.roles)
    if unknown:
        raise ConfigError(f"snapshot roles {sorted(unknown)} are not among the allowed roles")
    return config


def _check_relay(config: Config) -> None:
    """--source relay needs --upstream, which nothing else takes; the upstream's TLS
    files go with a CA, as `jobsignal subscribe`'s do."""
    relay = config.source == "relay"
    if relay and config.upstream is None:
        raise ConfigError("--source relay needs --upstream HOST:PORT")
    if not relay and config.upstream is not None:
        raise ConfigError("--upstream is for --source relay")
    if not config.upstream_tls_ca and (
        config.upstream_tls_cert or config.upstream_tls_key or config.upstream_tls_server_name
    ):
        raise ConfigError(
            "--upstream-tls-cert, --upstream-tls-key and --upstream-tls-server-name need"
            " --upstream-tls-ca (a PEM CA bundle, or 'system' for the system's trust store)"
        )
    if bool(config.upstream_tls_cert) != bool(config.upstream_tls_key):
        raise ConfigError(
            "--upstream-tls-cert and --upstream-tls-key go together: give both or neither"
        )


# Every setting at its default: the layers' keyword defaults read it, so a default is
# written once, in its `setting(...)` above.
DEFAULTS: Config = load_config({}, {})


def defaults() -> Config:
    return DEFAULTS


_READ = "jobsignal.reads_setting"


def from_setting(read: Callable[[Config], _T]) -> _T:
    """A field of a layer's settings (a `LayerSettings` dataclass) that `read` takes
    from a Config, converted as the layer keeps it (`lambda c: frozenset(c.roles)`);
    its default is read from DEFAULTS, so it cannot disagree with the setting's."""
    return dataclasses.field(default=read(DEFAULTS), metadata={_READ: read})


class LayerSettings:
    """Base of a layer's settings dataclass: `from_config` fills every field declared
    with `from_setting`; the other fields keep their defaults."""

    @classmethod
    def from_config(cls, config: Config) -> Self:
        fields = dataclasses.fields(cast(Any, cls))
        return cls(**{f.name: f.metadata[_READ](config) for f in fields if _READ in f.metadata})


def configure(**settings: object) -> Config:
    """A validated Config for programs embedding jobsignal; environment ignored.

    Keyword names are the settings' names (`listen="127.0.0.1:0"`,
    `idle_timeout=60`, `roles="CCAgent,FdAgent"`); values are checked exactly
    like the command line's, and a bad one raises ConfigError.
    """
    names = {setting.name for setting in SERVE_SETTINGS}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise ConfigError(f"unknown settings {unknown}; known: {sorted(names)}")
    return load_config({name: str(value) for name, value in settings.items()}, {})


def settings_table() -> str:
    """The README's configuration table (tests keep the README equal to this)."""
    rows = ["| flag | env var | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.flag}` | `{s.env}` | `{s.default}` | {s.help} |" for s in SERVE_SETTINGS]
    return "\n".join(rows) + "\n"
