"""Each setting reaches its layer, and no layer's default disagrees with the setting's.

The settings are declared once, as fields of `jobsignal.config.Config`; every
layer builds its own settings from a Config (`from_config`). These tests fail
when a from_config drops or misroutes a setting, when a layer default differs
from the declared one, and when a setting is read by nothing at all.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from jobsignal.config import DEFAULTS, Config, LayerSettings, configure
from jobsignal.fanout import Broadcaster
from jobsignal.kube.watcher import WatchSettings
from jobsignal.relay.settings import RelaySettings
from jobsignal.rpc.activity import PingPolicy
from jobsignal.rpc.guard import ProtocolLimits
from jobsignal.rpc.keepalive import KeepalivePolicy
from jobsignal.rpc.limits import Limits
from jobsignal.rpc.max_age import MaxAgePolicy
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import ServerSettings
from jobsignal.rpc.session import SessionSettings
from jobsignal.rpc.tls import TlsFiles

PACKAGE = Path(__file__).parent.parent / "jobsignal"

LAYER_SETTINGS: list[type[LayerSettings]] = [
    SessionSettings,
    PingPolicy,
    KeepalivePolicy,
    MaxAgePolicy,
    ProtocolLimits,
    Limits,
    WatchSettings,
    ServerSettings,
    RelaySettings,
]


def leaves(prefix: str, value: object) -> dict[str, object]:
    """A layer's settings as dotted paths, nested layer settings opened up."""
    if not isinstance(value, LayerSettings):
        return {prefix: value}
    found: dict[str, object] = {}
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        found.update(leaves(f"{prefix}.{field.name}", getattr(value, field.name)))
    return found


def broadcaster_limits(broadcaster: Broadcaster) -> dict[str, object]:
    # Private: the broadcaster has no reason to show its bounds to anyone else.
    return {
        "broadcaster.max_pending": broadcaster._max_pending,
        "broadcaster.max_pending_bytes": broadcaster._max_pending_bytes,
        "broadcaster.max_message_bytes": broadcaster._max_message_bytes,
    }


def registry_limits(registry: Registry) -> dict[str, object]:
    names = ["roles", "max_registrations", "max_subscriptions_per_role", "ttl"]
    names += ["max_registrations_per_ip", "max_subscriptions_per_role_per_ip"]
    return {f"registry.{name}": getattr(registry, name) for name in names}


def built(config: Config) -> dict[str, object]:
    """Every layer as `run_jobsignal` builds it from `config`."""
    return {
        **leaves("server", ServerSettings.from_config(config)),
        **leaves("watch", WatchSettings.from_config(config)),
        **leaves("relay", RelaySettings.from_config(config)),
        **broadcaster_limits(Broadcaster.from_config(config)),
        **registry_limits(Registry.from_config(config)),
    }


# Per setting: a value other than its default, and the layer field it must
# reach, which then holds that value as the Config does; or, where the layer
# keeps another form, every field that must change and to what. The values
# differ from each other, so a swap fails too.
CERT, KEY, CA = Path("c.pem"), Path("k.pem"), Path("ca.pem")
# The relay's TLS files, which go together.
UPSTREAM_FILES: dict[str, object] = {
    "relay.tls_ca": "ca.pem",
    "relay.tls_cert": "c.pem",
    "relay.tls_key": "k.pem",
}
REACHES: dict[str, tuple[str, str | dict[str, object]]] = {
    "listen": (
        "127.0.0.1:9001,[::1]:9002",
        {
            "server.host": "127.0.0.1",
            "server.port": 9001,
            "server.more_addresses": (("::1", 9002),),
        },
    ),
    "tls_cert": ("c.pem", {"server.tls": TlsFiles(CERT, KEY)}),
    "tls_key": ("k.pem", {"server.tls": TlsFiles(CERT, KEY)}),
    "tls_client_ca": ("ca.pem", {"server.tls": TlsFiles(CERT, KEY, CA)}),
    "tls_reload_interval": ("31", "server.tls_reload_interval"),
    "namespaces": ("a,b", "watch.namespaces"),
    "label_selector": ("app=x", "watch.label_selector"),
    "watch_timeout": ("301", "watch.watch_timeout"),
    "idle_timeout": ("121", "server.session.idle_timeout"),
    "roles": ("FdAgent,Other", "registry.roles"),
    "snapshot_roles": ("CCAgent", {"server.session.snapshot_roles": frozenset({"CCAgent"})}),
    "max_subscriptions_per_role": ("21", "registry.max_subscriptions_per_role"),
    "max_subscriptions_per_role_per_ip": ("11", "registry.max_subscriptions_per_role_per_ip"),
    "max_registrations": ("1025", "registry.max_registrations"),
    "max_registrations_per_ip": ("129", "registry.max_registrations_per_ip"),
    "registration_ttl": ("302", "registry.ttl"),
    "max_pending_messages": ("1026", "broadcaster.max_pending"),
    "max_pending_bytes": ("67108865", "broadcaster.max_pending_bytes"),
    "send_timeout": ("61", "server.session.send_timeout"),
    "request_timeout": ("11", "server.session.request_timeout"),
    "keepalive_time": ("62", "server.keepalive.interval"),
    "keepalive_timeout": ("6", "server.keepalive.timeout"),
    "max_connection_age": ("3600", "server.max_age.age"),
    "max_connection_age_grace": (
        "60",
        {"server.max_age.age": 3600.0, "server.max_age.grace": 60.0},
    ),
    "min_client_ping_interval": ("4", "server.ping_policy.min_interval"),
    "ping_strikes": ("3", "server.ping_policy.max_strikes"),
    "handshake_timeout": ("7", "server.protocol_limits.handshake_timeout"),
    "max_stream_resets_per_second": ("104", "server.protocol_limits.max_resets_per_second"),
    "max_control_frames_per_second": (
        "501",
        "server.protocol_limits.max_control_frames_per_second",
    ),
    "max_control_frames_per_second_per_ip": (
        "2001",
        "server.protocol_limits.max_control_frames_per_second_per_ip",
    ),
    "read_bytes_per_turn": ("16385", "server.protocol_limits.read_bytes_per_turn"),
    "write_stall_timeout": ("33", "server.protocol_limits.write_stall_timeout"),
    "max_request_bytes": ("4097", "server.max_request_bytes"),
    "max_send_bytes": ("4194306", "broadcaster.max_message_bytes"),
    "max_connections": ("1027", "server.limits.max_connections"),
    "max_connections_per_ip": ("513", "server.limits.max_connections_per_ip"),
    "max_streams_per_connection": ("65", "server.limits.max_streams_per_connection"),
    "register_rate": ("102", "server.limits.register_rate"),
    "register_burst": ("201", "server.limits.register_burst"),
    "subscribe_rate": ("103", "server.limits.subscribe_rate"),
    "subscribe_burst": ("202", "server.limits.subscribe_burst"),
    "shutdown_grace": ("8", "server.shutdown_grace"),
    "upstream": ("127.0.0.1:9003", {"relay.upstream": ("127.0.0.1", 9003)}),
    "upstream_role": ("FdAgent", "relay.role"),
    "upstream_tls_ca": ("ca.pem", "relay.tls_ca"),
    "upstream_tls_cert": ("c.pem", UPSTREAM_FILES),
    "upstream_tls_key": ("k.pem", UPSTREAM_FILES),
    "upstream_tls_server_name": ("up", {"relay.tls_ca": "ca.pem", "relay.tls_server_name": "up"}),
    "upstream_grace": ("32", "relay.grace"),
    "upstream_max_message_bytes": ("16777217", "relay.max_message_bytes"),
}
# Settings load_config accepts only together with others: the TLS files; the
# upstream's (and the upstream itself, which needs --source relay: no layer's).
TLS = {"tls_cert": "c.pem", "tls_key": "k.pem"}
UPSTREAM_TLS = {
    "upstream_tls_ca": "ca.pem",
    "upstream_tls_cert": "c.pem",
    "upstream_tls_key": "k.pem",
}
NEEDS: dict[str, dict[str, str]] = {
    **{name: TLS for name in ("tls_cert", "tls_key", "tls_client_ca")},
    "upstream": {"source": "relay"},
    "max_connection_age_grace": {"max_connection_age": "3600"},
    "upstream_tls_cert": UPSTREAM_TLS,
    "upstream_tls_key": UPSTREAM_TLS,
    "upstream_tls_server_name": {"upstream_tls_ca": "ca.pem"},
}

# Settings no layer takes: the module that reads them from its Config instead.
READ_BY_MODULE = {
    "metrics_listen": "app.py",
    "source": "app.py",
    "kubeconfig": "app.py",
    "context": "app.py",
    "read_timeout": "app.py",
    "drain_delay": "app.py",
    "log_level": "cli.py",
    "log_format": "cli.py",
}


def test_every_setting_is_taken_by_a_layer_or_read_by_a_module() -> None:
    names = {field.name for field in dataclasses.fields(Config)}
    assert not set(REACHES) & set(READ_BY_MODULE)
    assert set(REACHES) | set(READ_BY_MODULE) == names


@pytest.mark.parametrize("name", sorted(REACHES))
def test_a_setting_reaches_its_layer(name: str) -> None:
    value, reaches = REACHES[name]
    config = configure(**{**NEEDS.get(name, {}), name: value})
    assert getattr(config, name) != getattr(DEFAULTS, name), "not a new value"
    expected = {reaches: getattr(config, name)} if isinstance(reaches, str) else reaches
    before, after = built(DEFAULTS), built(config)
    changed = {path: after.get(path) for path in before.keys() | after.keys()}
    changed = {path: value for path, value in changed.items() if value != before.get(path)}
    assert changed == expected


@pytest.mark.parametrize("name", sorted(READ_BY_MODULE))
def test_a_setting_no_layer_takes_is_read_by_its_module(name: str) -> None:
    tree = ast.parse((PACKAGE / READ_BY_MODULE[name]).read_text())
    reads = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "config"
    }
    assert name in reads, f"nothing in {READ_BY_MODULE[name]} reads config.{name}"


def _all_subclasses(cls: type[Any]) -> set[type[Any]]:
    found = set(cls.__subclasses__())
    return found.union(*(_all_subclasses(sub) for sub in found))


def test_every_layer_settings_class_is_checked() -> None:
    assert _all_subclasses(LayerSettings) == set(LAYER_SETTINGS)


@pytest.mark.parametrize("layer", LAYER_SETTINGS, ids=lambda layer: layer.__name__)
def test_a_layers_defaults_are_the_settings_defaults(layer: type[LayerSettings]) -> None:
    # Field by field, so a disagreement names the field.
    assert leaves(layer.__name__, layer.from_config(DEFAULTS)) == leaves(layer.__name__, layer())


def test_the_broadcasters_defaults_are_the_settings_defaults() -> None:
    assert broadcaster_limits(Broadcaster.from_config(DEFAULTS)) == broadcaster_limits(
        Broadcaster()
    )


def test_from_config_keeps_what_is_not_a_setting() -> None:
    config = configure(watch_timeout=30, listen="127.0.0.1:0")
    assert WatchSettings.from_config(config).page_size == WatchSettings().page_size
    assert ServerSettings.from_config(config).backlog == ServerSettings().backlog
