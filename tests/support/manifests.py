"""What the deploy/ checks share (tests/deploy/test_manifests.py, test_ha.py): the
manifests and kustomizations loaded, rendering with kubectl, the schema and
object checks, and the constants they hold the manifests to."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cache
from itertools import combinations
from pathlib import Path
from typing import Any, NoReturn

# Untyped; installed with kubernetes-validate, which validates with it too.
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import trio
import yaml

import jobsignal
from jobsignal.config import SERVE_SETTINGS, Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


DEPLOY = ROOT / "deploy"


KUBE = DEPLOY / "kubernetes"


DOCKERFILE = DEPLOY / "Dockerfile"


# The newest schema set that kubernetes-validate 1.37.0 bundles, and the oldest
# Kubernetes the manifests claim to support (native sidecars in the example),
# so that a field only newer clusters know (grpc probe `mode`, say) is caught.
K8S_VERSIONS = ("1.37.0", "1.29.0")


GRPC_PORT = 8899


METRICS_PORT = 9090


UID = 10001


IMAGE = "jobsignal"


KUSTOMIZATION_NAMES = frozenset({"kustomization.yaml", "kustomization.yml", "Kustomization"})


KUSTOMIZE_KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}


WORKLOAD_KINDS = frozenset({"Deployment", "Pod"})


RBAC_ROLE_KINDS = frozenset({"Role", "ClusterRole"})


RBAC_BINDING_KINDS = frozenset({"RoleBinding", "ClusterRoleBinding"})


READ_VERBS = frozenset({"get", "list", "watch"})


# Kubernetes' recommended labels, all on every object of an install.
RECOMMENDED_LABELS = tuple(
    f"app.kubernetes.io/{key}"
    for key in ("name", "instance", "version", "component", "part-of", "managed-by")
)


# The only ones a selector may use: version changes with every release, and a
# Deployment's selector cannot change at all.
STABLE_LABELS = frozenset({"app.kubernetes.io/name", "app.kubernetes.io/instance"})


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# Plain-text gRPC is HTTP/2 with prior knowledge: the Kubernetes-defined name.
GRPC_APP_PROTOCOL = "kubernetes.io/h2c"


# The kubelet's default when a pod says nothing.
DEFAULT_TERMINATION_GRACE = 30


# After the drain and the shutdown grace: interpreter exit, a busy node.
TERMINATION_MARGIN = 5.0


# Behind a Service, the pod keeps accepting this long after SIGTERM, while
# the endpoint removal reaches kube-proxy, gateways and meshes.
MIN_DRAIN_BEHIND_SERVICE = 5.0


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


MONITORING_GROUP = "monitoring.coreos.com"


FLAGS = {setting.flag: setting for setting in SERVE_SETTINGS}


ENV_VARS = {setting.env: setting for setting in SERVE_SETTINGS}


# What a downward-API env var stands for when the manifests are checked offline.
FIELD_REF_SAMPLES = {"metadata.namespace": "example-namespace"}


Obj = dict[str, Any]


@dataclass(frozen=True)
class Manifest:
    """One YAML document of a manifest file."""

    path: Path
    index: int
    body: Obj

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.body.get("metadata", {}).get("name", ""))

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}#{self.index} {self.kind}/{self.name}"


def _yaml_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml"))


def _is_kustomization(path: Path) -> bool:
    return path.name in KUSTOMIZATION_NAMES


def _documents(text: str, source: str) -> list[Obj]:
    docs: list[Obj] = []
    for doc in yaml.safe_load_all(text):
        if doc is None:
            continue
        assert isinstance(doc, dict), f"{source}: a document is not a mapping"
        docs.append(doc)
    return docs


def _load_manifests() -> list[Manifest]:
    return [
        Manifest(path, index, body)
        for path in _yaml_files(KUBE)
        if not _is_kustomization(path)
        for index, body in enumerate(_documents(path.read_text(), str(path)))
    ]


def _kustomizations() -> list[Path]:
    return [path for path in _yaml_files(KUBE) if _is_kustomization(path)]


MANIFESTS = _load_manifests()


KUSTOMIZATIONS = _kustomizations()


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def _pod_spec(obj: Mapping[str, Any]) -> Obj:
    if obj["kind"] == "Pod":
        spec: Obj = obj["spec"]
    else:
        spec = obj["spec"]["template"]["spec"]
    return spec


def _pod_labels(obj: Mapping[str, Any]) -> Obj:
    if obj["kind"] == "Pod":
        labels: Obj = obj["metadata"].get("labels", {})
    else:
        labels = obj["spec"]["template"]["metadata"].get("labels", {})
    return labels


def _containers(pod_spec: Mapping[str, Any]) -> list[Obj]:
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]


def _jobsignal_container(obj: Mapping[str, Any]) -> Obj:
    found = [c for c in _containers(_pod_spec(obj)) if c["name"] == "jobsignal"]
    assert len(found) == 1, f"{obj['kind']}/{obj['metadata']['name']}: no 'jobsignal' container"
    return found[0]


def _serve_flags(args: Sequence[str], where: str) -> dict[str, str | None]:
    """The settings given on a `jobsignal serve` command line, by setting name."""
    if not args or args[0] != "serve":
        _fail(f"{where}: args {list(args)} do not start with the 'serve' command")
    flags: dict[str, str | None] = {}
    rest = list(args[1:])
    while rest:
        token = rest.pop(0)
        flag, eq, value = token.partition("=")
        if flag not in FLAGS:
            _fail(f"{where}: `jobsignal serve` has no flag {flag!r} (see jobsignal/config.py)")
        if not eq:
            if not rest:
                _fail(f"{where}: flag {flag} has no value")
            value = rest.pop(0)
        flags[FLAGS[flag].name] = value
    return flags


def _env_values(container: Mapping[str, Any], where: str) -> dict[str, str]:
    """The JOBSIGNAL_* variables of a container, downward-API ones as sample values."""
    values: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if name not in ENV_VARS:
            _fail(
                f"{where}: env {name} is not a `jobsignal serve` setting"
                f" (known: {', '.join(sorted(ENV_VARS))})"
            )
        if "value" in entry:
            values[name] = str(entry["value"])
            continue
        field_path = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field_path not in FIELD_REF_SAMPLES:
            _fail(f"{where}: env {name} must be a value or a known fieldRef, not {entry}")
        values[name] = FIELD_REF_SAMPLES[field_path]
    return values


def _serve_config(args: Sequence[str], env: Mapping[str, str], where: str) -> Config:
    """The Config that `jobsignal serve` builds from these args and env, as cli.main does."""
    try:
        return load_config(_serve_flags(args, where), env)
    except ConfigError as error:
        _fail(f"{where}: jobsignal rejects its configuration: {error}")


def _security(pod_spec: Mapping[str, Any], container: Mapping[str, Any]) -> Obj:
    """The container's effective security settings (the container's own win)."""
    merged: Obj = dict(pod_spec.get("securityContext", {}))
    merged.update(container.get("securityContext", {}))
    return merged


# The Prometheus Operator's ServiceMonitor and PrometheusRule
# (monitoring.coreos.com/v1), reduced to the fields these manifests may use and
# strict like the Kubernetes check: anything else, a misspelt field included, is
# an error. Field names and types
# follow the operator's CRD; extend the schema when a manifest needs more.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


_STRINGS = {"type": "array", "items": {"type": "string"}}


_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}


_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": _STRINGS,
                },
            },
        },
    },
}


_SCRAPE_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "targetPort": {"type": ["integer", "string"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
    },
}


_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}


# One rule of a PrometheusRule's group: an alert or a recording rule, as the
# operator's CRD (and Prometheus' rules file) has them.
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}


def _monitoring_kind(kind: str, spec: Obj) -> Obj:
    """A strict schema of a monitoring.coreos.com/v1 object of `kind` with this `spec`."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": f"{MONITORING_GROUP}/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


MONITOR_SCHEMAS: dict[str, Obj] = {
    "PrometheusRule": _monitoring_kind(
        "PrometheusRule",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {"type": "array", "minItems": 1, "items": _RULE},
                        },
                    },
                },
            },
        },
    ),
    "ServiceMonitor": _monitoring_kind(
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _SCRAPE_ENDPOINT},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STRINGS},
                },
                "jobLabel": {"type": "string"},
                "targetLabels": _STRINGS,
                "podTargetLabels": _STRINGS,
            },
        },
    ),
}


def _validate_monitoring(body: Obj, where: str) -> None:
    schema = MONITOR_SCHEMAS.get(str(body.get("kind")))
    if schema is None:
        _fail(f"{where}: no schema here for {MONITORING_GROUP} kind {body.get('kind')!r}")
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(body), key=lambda error: list(error.path))
    if errors:
        path = ".".join(str(part) for part in errors[0].path) or "(top level)"
        _fail(f"{where}: not a valid {body['kind']}: {path}: {errors[0].message}")


def _validate_schema(body: Obj, where: str) -> None:
    if str(body.get("apiVersion", "")).startswith(f"{MONITORING_GROUP}/"):
        _validate_monitoring(body, where)
        return
    for version in K8S_VERSIONS:
        try:
            validated = kubernetes_validate.validate(body, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path) or "(top level)"
            _fail(f"{where}: not valid Kubernetes {version}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            _fail(f"{where}: {error.message}")
        # The schemas of exactly that version were used, not an older fallback.
        assert validated == version.rpartition(".")[0]


def _kustomization(path: Path) -> Obj:
    docs = _documents(path.read_text(), str(path))
    assert len(docs) == 1, f"{path}: one document expected"
    return docs[0]


def _kustomize_resources(directory: Path) -> list[Obj]:
    """The objects a kustomization directory starts from (before patches)."""
    found: list[Obj] = []
    for entry in _kustomization(directory / "kustomization.yaml").get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            found += _kustomize_resources(target)
        elif target.is_file():  # a missing one fails test_kustomization_resources_exist
            found += _documents(target.read_text(), str(target))
    return found


def _is_component(directory: Path) -> bool:
    return _kustomization(directory / "kustomization.yaml").get("kind") == "Component"


COMPONENTS = [path.parent for path in KUSTOMIZATIONS if _is_component(path.parent)]


@dataclass(frozen=True)
class ComponentPurpose:
    """What an optional component is meant to do to an install, and nothing more.

    `adds`: the kinds of the objects it adds, one entry per object. `changes`:
    per (kind, name) of an install's object, the dotted field paths its patches
    set (a list counts as one field, replaced or merged as a whole).
    """

    adds: tuple[str, ...]
    changes: Mapping[tuple[str, str], frozenset[str]] = field(default_factory=dict)


COMPONENT_PURPOSES = {
    # A ServiceMonitor and the alerting rules, and the install itself unchanged.
    "prometheus-operator": ComponentPurpose(adds=("ServiceMonitor", "PrometheusRule")),
    # Who may connect to which port, and the install itself unchanged.
    "networkpolicy": ComponentPurpose(adds=("NetworkPolicy",)),
    # Several replicas: a PodDisruptionBudget, and the Deployment's replica
    # count, pod spreading and the container's environment (a maximum connection
    # age: tests/deploy/test_ha.py checks it, and that the base's env is kept).
    "ha": ComponentPurpose(
        adds=("PodDisruptionBudget",),
        changes={
            ("Deployment", "jobsignal"): frozenset(
                {
                    "spec.replicas",
                    "spec.template.spec.topologySpreadConstraints",
                    "spec.template.spec.containers",
                }
            )
        },
    ),
}


def _purpose(component: Path) -> ComponentPurpose:
    purpose = COMPONENT_PURPOSES.get(component.name)
    if purpose is None:
        _fail(f"{_rel(component)}: declare what it adds and changes in COMPONENT_PURPOSES")
    return purpose


def _patch_bodies(directory: Path) -> list[Obj]:
    """The inline patches of a kustomization, parsed (one object each)."""
    kustomization = _kustomization(directory / "kustomization.yaml")
    return [
        _documents(patch["patch"], str(directory))[0]
        for patch in kustomization.get("patches", [])
        if "patch" in patch
    ]


_ABSENT = object()


def _differences(before: Any, after: Any, path: str = "") -> Iterator[str]:
    """The dotted paths of the leaves at which two objects differ (a mapping
    missing on one side counts as empty; lists are compared whole)."""
    if before is _ABSENT and isinstance(after, dict):
        before = {}
    if after is _ABSENT and isinstance(before, dict):
        after = {}
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(before.keys() | after.keys()):
            yield from _differences(
                before.get(key, _ABSENT), after.get(key, _ABSENT), f"{path}.{key}" if path else key
            )
    elif before != after:
        yield path


def _leaf_paths(patch: Obj) -> set[str]:
    """The fields a strategic-merge patch sets, as dotted paths (its target's
    identity, apiVersion, kind and metadata.name, left out)."""
    body = copy.deepcopy(patch)
    for identity in ("apiVersion", "kind"):
        body.pop(identity, None)
    metadata = body.get("metadata", {})
    metadata.pop("name", None)
    if not metadata:
        body.pop("metadata", None)
    return set(_differences({}, body))


def _covered(path: str, allowed: AbstractSet[str]) -> bool:
    return any(path == field or path.startswith(f"{field}.") for field in allowed)


def _check_rbac(objects: Sequence[Obj], where: str) -> None:
    roles = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in RBAC_ROLE_KINDS}
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind in RBAC_ROLE_KINDS:
            assert "aggregationRule" not in obj, f"{where}: {kind}/{name} aggregates other roles"
            rules = obj.get("rules", [])
            assert rules, f"{where}: {kind}/{name} has no rules"
            for rule in rules:
                assert rule.get("apiGroups") == [""], f"{where}: {kind}/{name}: {rule}"
                assert rule.get("resources") == ["configmaps"], f"{where}: {kind}/{name}: {rule}"
                verbs = rule.get("verbs", [])
                assert verbs, f"{where}: {kind}/{name}: rule without verbs"
                assert set(verbs) <= READ_VERBS, f"{where}: {kind}/{name}: verbs {verbs}"
                assert "nonResourceURLs" not in rule, f"{where}: {kind}/{name}: {rule}"
        elif kind in RBAC_BINDING_KINDS:
            # A binding to a role defined elsewhere (cluster-admin, say) would
            # escape the rule checks above.
            ref = obj["roleRef"]
            assert (ref["kind"], ref["name"]) in roles, f"{where}: {kind}/{name} binds {ref}"
            if kind == "ClusterRoleBinding":
                assert ref["kind"] == "ClusterRole"
            for subject in obj["subjects"]:
                assert subject["kind"] == "ServiceAccount", f"{where}: {kind}/{name}: {subject}"
                assert subject["name"] in accounts, f"{where}: {kind}/{name}: {subject}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _installed_kustomizations() -> list[Path]:
    """Kustomization directories that are applied (not only used as a base, not components)."""
    bases = {
        (path.parent / entry).resolve()
        for path in KUSTOMIZATIONS
        for entry in _kustomization(path).get("resources", [])
    }
    return [
        path.parent
        for path in KUSTOMIZATIONS
        if path.parent.resolve() not in bases and not _is_component(path.parent)
    ]


ROOT_KUSTOMIZATIONS = _installed_kustomizations()


def _component_sets() -> list[tuple[Path, ...]]:
    """Every non-empty combination of the optional components."""
    return [
        chosen
        for size in range(1, len(COMPONENTS) + 1)
        for chosen in combinations(COMPONENTS, size)
    ]


def _install_name(root: Path, components: Sequence[Path]) -> str:
    return "+".join([_rel(root), *(_rel(component) for component in components)])


def _installs() -> dict[str, list[Obj]]:
    """The objects that are installed together, by name: a kustomization tree
    (before patches), one example file, or an install with components added
    (their resources, before their patches: rendering applies those)."""
    groups: dict[str, list[Obj]] = {}
    for path in KUSTOMIZATIONS:
        if not _is_component(path.parent):  # a component is no install on its own
            groups[_rel(path.parent)] = _kustomize_resources(path.parent)
    for manifest in MANIFESTS:
        if KUBE / "examples" in manifest.path.parents:
            groups.setdefault(_rel(manifest.path), []).append(manifest.body)
    for root in ROOT_KUSTOMIZATIONS:
        for components in _component_sets():
            objects = _kustomize_resources(root)
            for component in components:
                objects += _kustomize_resources(component)
            groups[_install_name(root, components)] = objects
    return groups


INSTALLS = _installs()


def _label_sets(obj: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, str]]]:
    """Where an object carries labels: its own, and its pods' for a workload."""
    here = f"{obj['kind']}/{obj['metadata']['name']}"
    yield here, obj["metadata"].get("labels", {})
    if obj["kind"] in WORKLOAD_KINDS and obj["kind"] != "Pod":
        yield f"{here} pod template", obj["spec"]["template"]["metadata"].get("labels", {})


def _selectors(obj: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every label selector of an object, as written (matchLabels form or a Service's map)."""
    here = f"{obj['kind']}/{obj['metadata']['name']}"
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        yield f"{here} selector", {"matchLabels": spec.get("selector", {})}
    elif obj["kind"] == "Deployment":
        yield f"{here} selector", spec["selector"]
    elif obj["kind"] == "NetworkPolicy":
        yield f"{here} podSelector", spec["podSelector"]
    elif obj["kind"] in ("ServiceMonitor", "PodDisruptionBudget"):
        yield f"{here} selector", spec["selector"]


def _check_labels(objects: Sequence[Obj], where: str) -> None:
    """The full recommended label set, the same on every object; selectors on stable labels."""
    expected: dict[str, str] | None = None
    for obj in objects:
        for here, labels in _label_sets(obj):
            missing = [key for key in RECOMMENDED_LABELS if key not in labels]
            assert not missing, f"{where}: {here} lacks {missing}"
            own = {key: labels[key] for key in RECOMMENDED_LABELS}
            for key, value in own.items():
                valid = isinstance(value, str) and bool(value) and len(value) <= 63
                assert valid and LABEL_VALUE.match(value), f"{where}: {here}: {key}={value!r}"
            expected = own if expected is None else expected
            assert own == expected, f"{where}: {here} has labels {own}, others {expected}"
    assert expected is not None, f"{where}: no objects"
    version = expected["app.kubernetes.io/version"]
    assert version == jobsignal.__version__, f"{where}: version label {version}"
    for obj in objects:
        for here, selector in _selectors(obj):
            assert not selector.get("matchExpressions"), f"{where}: {here} uses matchExpressions"
            keys = set(selector.get("matchLabels", {}))
            assert keys, f"{where}: {here} selects everything"
            assert keys <= STABLE_LABELS, f"{where}: {here} uses {keys - STABLE_LABELS}"
            assert "app.kubernetes.io/name" in keys, f"{where}: {here} without the name"
        if obj["kind"] == "Deployment":
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= _pod_labels(obj).items(), f"{where}: selects no own pod"


def _addresses(value: Any) -> list[tuple[str, int]]:
    """A listen setting's HOST:PORT pairs: none (off), one, or several."""
    if value is None:
        return []
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return [value]
    return [(str(host), int(port)) for host, port in value]


def _container_config(obj: Mapping[str, Any], here: str) -> Config:
    container = _jobsignal_container(obj)
    return _serve_config(container.get("args", []), _env_values(container, here), here)


def _check_workloads(objects: Sequence[Obj], where: str) -> None:
    """Probes, security, resources, shutdown and the serve configuration of every workload."""
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    assert workloads, f"{where}: no workload"
    for obj in workloads:
        here = f"{where}: {obj['kind']}/{obj['metadata']['name']}"
        spec = _pod_spec(obj)
        _check_pod(spec, accounts, here)
        for container in _containers(spec):
            _check_container_security(spec, container, f"{here} container {container['name']}")
        _check_jobsignal_container(obj, f"{here} container jobsignal")


def _check_pod(spec: Mapping[str, Any], accounts: Mapping[str, Obj], here: str) -> None:
    account = str(spec.get("serviceAccountName", ""))
    assert account in accounts, f"{here}: service account {account!r} is not in the install"
    # jobsignal reads the service-account token to talk to the API server.
    assert spec.get("automountServiceAccountToken") is True, f"{here}: token not mounted"
    assert accounts[account].get("automountServiceAccountToken", True) is True
    # A Service named "jobsignal" would otherwise inject JOBSIGNAL_SERVICE_HOST,
    # JOBSIGNAL_PORT, ... into the prefix of jobsignal's own settings.
    assert spec.get("enableServiceLinks") is False, f"{here}: enableServiceLinks must be false"
    for host_access in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host_access), f"{here}: {host_access}"


def _check_container_security(
    spec: Mapping[str, Any], container: Mapping[str, Any], here: str
) -> None:
    security = _security(spec, container)
    assert security.get("runAsNonRoot") is True, f"{here}: runAsNonRoot"
    assert security.get("runAsUser") == UID, f"{here}: runAsUser {security.get('runAsUser')}"
    assert security.get("readOnlyRootFilesystem") is True, f"{here}: readOnlyRootFilesystem"
    assert security.get("allowPrivilegeEscalation") is False, f"{here}: allowPrivilegeEscalation"
    assert not security.get("privileged"), f"{here}: privileged"
    capabilities = security.get("capabilities", {})
    assert capabilities.get("drop") == ["ALL"], f"{here}: capabilities.drop"
    assert not capabilities.get("add"), f"{here}: capabilities.add"
    assert security.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{here}: seccomp"
    resources = container.get("resources", {})
    for bound in ("requests", "limits"):
        assert set(resources.get(bound, {})) >= {"cpu", "memory"}, f"{here}: resources.{bound}"


def _check_jobsignal_container(obj: Mapping[str, Any], here: str) -> None:
    container = _jobsignal_container(obj)
    repository, _, tag = container["image"].rpartition(":")
    assert repository.rsplit("/", 1)[-1] == IMAGE, f"{here}: image {container['image']}"
    assert tag == jobsignal.__version__, f"{here}: image tag {tag} != {jobsignal.__version__}"
    assert "command" not in container, f"{here}: command overrides the image's ENTRYPOINT"

    config = _container_config(obj, here)
    assert config.source == "kubernetes", f"{here}: must not fall back to the demo cluster"
    assert config.log_format == "json", f"{here}: logs must be JSON lines"

    ports = {port["name"]: port for port in container.get("ports", [])}
    grpc = _addresses(config.listen)
    assert grpc and all(port == GRPC_PORT for _, port in grpc), f"{here}: listens on {grpc}"
    if all(host in LOOPBACK_HOSTS for host, _ in grpc):
        # Only the pod's own containers can reach it: declaring it would mislead.
        assert "grpc" not in ports, f"{here}: declares a grpc port it listens on loopback only"
    else:
        assert ports.get("grpc") == {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}

    # Metrics on, on the pod IP: the kubelet's probes and Prometheus come from outside.
    metrics = _addresses(config.metrics_listen)
    assert metrics, f"{here}: metrics are off (set JOBSIGNAL_METRICS_LISTEN)"
    for host, port in metrics:
        assert host not in LOOPBACK_HOSTS, f"{here}: metrics on {host}, out of the kubelet's reach"
        assert port == METRICS_PORT, f"{here}: metrics on port {port}"
    metrics_port = {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}
    assert ports.get("metrics") == metrics_port, f"{here}: no metrics port {metrics_port}"

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        assert probe is not None, f"{here}: no {kind}"
        handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & probe.keys()
        # HTTP on the metrics port works under mutual TLS too (the kubelet
        # has no client certificate for the gRPC port).
        assert handlers == {"httpGet"}, f"{here}: {kind} must be an HTTP probe, not {handlers}"
        get = probe["httpGet"]
        assert get.get("port") == "metrics", f"{here}: {kind} not on the named metrics port"
        assert get.get("scheme", "HTTP") == "HTTP", f"{here}: {kind}: metrics are plain HTTP"
        assert str(get.get("path", "")).startswith("/"), f"{here}: {kind} has no path"

    # Liveness must not kill a pod whose first LIST is slow: the startup probe
    # gives the first LIST minutes; liveness itself tolerates a minute of
    # missed answers.
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, f"{here}: startup"
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60, f"{here}: liveness"

    annotations = obj["metadata"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]
    scrape = annotations.get("annotations", {})
    assert scrape.get("prometheus.io/scrape") == "true", f"{here}: no prometheus.io/scrape"
    assert scrape.get("prometheus.io/port") == str(METRICS_PORT), f"{here}: prometheus.io/port"
    assert str(scrape.get("prometheus.io/path", "")).startswith("/"), f"{here}: prometheus.io/path"

    _check_shutdown(_pod_spec(obj), container, config, here)


def _check_shutdown(
    spec: Mapping[str, Any], container: Mapping[str, Any], config: Config, here: str
) -> None:
    # The drain announces itself (health NOT_SERVING, /readyz 503) while still
    # serving; a preStop sleep would hold SIGTERM back and keep health SERVING.
    assert "preStop" not in container.get("lifecycle", {}), f"{here}: preStop before the drain"
    grace = spec.get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE)
    needed = config.drain_delay + config.shutdown_grace + TERMINATION_MARGIN
    assert grace >= needed, (
        f"{here}: terminationGracePeriodSeconds {grace} < drain {config.drain_delay:g}"
        f" + shutdown grace {config.shutdown_grace:g} + {TERMINATION_MARGIN:g} s margin"
    )


# Each Service port: the container port it must reach and its appProtocol.
SERVICE_PORTS = {
    "grpc": (GRPC_PORT, GRPC_APP_PROTOCOL),
    "metrics": (METRICS_PORT, "http"),
}


def _selected_workloads(service: Mapping[str, Any], objects: Sequence[Obj]) -> list[Obj]:
    selector = service["spec"].get("selector", {})
    return [
        o
        for o in objects
        if o["kind"] in WORKLOAD_KINDS and selector and selector.items() <= _pod_labels(o).items()
    ]


def _check_services(objects: Sequence[Obj], where: str) -> None:
    for service in (o for o in objects if o["kind"] == "Service"):
        here = f"{where}: Service/{service['metadata']['name']}"
        spec = service["spec"]
        assert spec.get("type", "ClusterIP") == "ClusterIP", here
        selected = _selected_workloads(service, objects)
        assert len(selected) == 1, f"{here}: selector {spec['selector']} matches {len(selected)}"
        container = _jobsignal_container(selected[0])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert sorted(p["name"] for p in spec["ports"]) == sorted(SERVICE_PORTS), here
        for port in spec["ports"]:
            number, app_protocol = SERVICE_PORTS[port["name"]]
            assert port["port"] == number, f"{here}: {port['name']} on {port['port']}"
            assert port.get("appProtocol") == app_protocol, f"{here}: {port['name']} appProtocol"
            target = port.get("targetPort", port["port"])
            assert target == port["name"], f"{here}: targetPort {target!r}: use the named port"
            assert named.get(target) == number, f"{here}: no container port {target!r}={number}"
        # Behind a Service, new clients keep arriving until every proxy has
        # seen the endpoint go: the drain must outlast that.
        config = _container_config(selected[0], here)
        assert config.drain_delay >= MIN_DRAIN_BEHIND_SERVICE, f"{here}: drain too short"


def _check_monitors(objects: Sequence[Obj], where: str) -> None:
    """Each ServiceMonitor selects exactly one Service of the install, by its metrics port."""
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        here = f"{where}: ServiceMonitor/{monitor['metadata']['name']}"
        spec = monitor["spec"]
        # No namespaceSelector: the Service's namespace is the monitor's own.
        assert "namespaceSelector" not in spec, f"{here}: looks in other namespaces"
        selector = spec["selector"].get("matchLabels", {})
        selected = [
            s for s in services if selector.items() <= s["metadata"].get("labels", {}).items()
        ]
        assert len(selected) == 1, f"{here}: selects {len(selected)} Services"
        (service,) = selected
        assert len(_selected_workloads(service, objects)) == 1, f"{here}: Service selects no pod"
        ports = {port["name"] for port in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint.get("port") == "metrics", f"{here}: scrapes {endpoint.get('port')!r}"
            assert "metrics" in ports, f"{here}: the Service has no metrics port"
            assert endpoint.get("scheme", "http") == "http", f"{here}: metrics are plain HTTP"


def _served_paths() -> dict[str, set[str]]:
    """The HTTP paths the manifests rely on, by what they are for."""
    paths: dict[str, set[str]] = {
        "startupProbe": set(),
        "readinessProbe": set(),
        "livenessProbe": set(),
        "metrics": set(),
    }
    for manifest in MANIFESTS:
        body = manifest.body
        if manifest.kind in WORKLOAD_KINDS:
            container = _jobsignal_container(body)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                paths[kind].add(container[kind]["httpGet"]["path"])
            meta = (
                body["metadata"] if manifest.kind == "Pod" else body["spec"]["template"]["metadata"]
            )
            paths["metrics"].add(meta["annotations"]["prometheus.io/path"])
        elif manifest.kind == "ServiceMonitor":
            for endpoint in body["spec"]["endpoints"]:
                paths["metrics"].add(endpoint.get("path", "/metrics"))
    return paths


async def _get(port: int, path: str) -> tuple[int, bytes]:
    """One GET as the kubelet or Prometheus sends it; (status, body)."""
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "User-Agent: kube-probe/1.37\r\nConnection: close\r\n\r\n".encode()
            )
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, "Dockerfile ends with a continuation line"
    return instructions


def _dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """The variables the image's ENV instructions set (`ENV NAME=value ...` form)."""
    env: dict[str, str] = {}
    for keyword, arguments in instructions:
        if keyword == "ENV":
            for pair in arguments.split():
                name, equals, value = pair.partition("=")
                assert equals, f"ENV {arguments!r}: use the NAME=value form"
                env[name] = value
    return env


def _dockerfile_stages(
    instructions: list[tuple[str, str]],
) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The global ARGs' defaults (those before the first FROM), and the instructions
    of each stage, each list starting with its FROM."""
    global_args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions:
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, arguments))
        elif keyword == "ARG":
            name, _, default = arguments.partition("=")
            global_args[name] = default
    return global_args, stages


def _expand(text: str, values: Mapping[str, str]) -> str:
    """`text` with $NAME and ${NAME} replaced as Docker does (unknown names fail)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"{text!r}: ${name} has no value"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def _exec_form(arguments: str, instruction: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), f"{instruction} must use the exec (JSON) form"
    return [str(part) for part in value]


def _render(directory: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return _documents(result.stdout, f"kustomize build {directory}")


def _check_rendered(objects: Sequence[Obj], where: str) -> None:
    for obj in objects:
        _validate_schema(obj, f"{where}: {obj['kind']}/{obj['metadata']['name']}")
    _check_rbac(objects, where)
    _check_workloads(objects, where)
    _check_services(objects, where)
    _check_labels(objects, where)
    _check_monitors(objects, where)
    namespaces = {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]}
    assert len(namespaces) == 1, f"{where}: objects in {namespaces}"
    for binding in (o for o in objects if o["kind"] in RBAC_BINDING_KINDS):
        assert {s["namespace"] for s in binding["subjects"]} == namespaces, binding


needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed"
)


@cache
def _rendered_once(directory: Path) -> tuple[Obj, ...]:
    return tuple(_render(directory))


def _plain_build(directory: Path) -> list[Obj]:
    """`kubectl kustomize` of an install as it is (rendered once per test run)."""
    return copy.deepcopy(list(_rendered_once(directory)))


def _by_identity(objects: Sequence[Obj]) -> dict[tuple[str, str], Obj]:
    found: dict[tuple[str, str], Obj] = {}
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in found, f"two objects {key}"
        found[key] = obj
    return found


def _check_component_effect(
    plain: Sequence[Obj], objects: Sequence[Obj], components: Sequence[Path], where: str
) -> None:
    """Rendered with the components, the install has exactly the objects they
    add on top of its own, and its own differ only in the fields they declare,
    each of which they do change."""
    purposes = [_purpose(component) for component in components]
    before, after = _by_identity(plain), _by_identity(objects)
    assert not before.keys() - after.keys(), f"{where}: lost {before.keys() - after.keys()}"
    added = [after[key] for key in after.keys() - before.keys()]
    kinds = sorted(o["kind"] for o in added)
    assert kinds == sorted(kind for p in purposes for kind in p.adds), f"{where}: adds {kinds}"
    # In the install's namespace, the only one the added objects look in.
    (service,) = [o for o in objects if o["kind"] == "Service"]
    for obj in added:
        namespace = obj["metadata"].get("namespace")
        assert namespace == service["metadata"]["namespace"], (
            f"{where}: {obj['kind']} in {namespace}"
        )
    allowed: dict[tuple[str, str], frozenset[str]] = {}
    for purpose in purposes:
        for target, fields in purpose.changes.items():
            allowed[target] = allowed.get(target, frozenset()) | fields
    for key in before.keys() & after.keys():
        changed = set(_differences(before[key], after[key]))
        fields = allowed.get(key, frozenset())
        stray = sorted(path for path in changed if not _covered(path, fields))
        assert not stray, f"{where}: {key} changed at {stray}"
        unchanged = sorted(f for f in fields if not any(_covered(path, {f}) for path in changed))
        assert not unchanged, f"{where}: {key} not changed at {unchanged}"


def _check_with_components(
    directory: Path, objects: Sequence[Obj], components: Sequence[Path], where: str
) -> None:
    _check_rendered(objects, where)
    _check_component_effect(_plain_build(directory), objects, components, where)


def _render_with(directory: Path, components: Sequence[Path], tmp_path: Path) -> list[Obj]:
    """An install with components added by an operator's own kustomization, which
    must name the namespace: the install's own `namespace:` does not reach a
    component added outside it."""
    namespace = _kustomization(directory / "kustomization.yaml")["namespace"]
    kustomization = {
        "apiVersion": KUSTOMIZE_KINDS["Kustomization"],
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": [os.path.relpath(directory, tmp_path)],
        "components": [os.path.relpath(component, tmp_path) for component in components],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return _render(tmp_path)
