"""Offline checks of deploy/: schemas, RBAC, labels, probes, drain, metrics and settings drift.

Every YAML document under deploy/kubernetes (base, overlays, components,
examples) is validated against the Kubernetes OpenAPI schemas bundled with the
kubernetes-validate package, in strict mode (unknown fields are errors), with
the network blocked. The Prometheus Operator's kinds (monitoring.coreos.com)
are not in those schemas: they are checked against a strict schema of the
fields the manifests may use, written here. kustomization.yaml files are not
Kubernetes objects: they are checked for resources that exist and patches
that hit something instead.

The rest pins what deploy/README.md promises: RBAC that reads ConfigMaps and
nothing else, the recommended app.kubernetes.io labels on every object with
selectors on the stable ones only, HTTP probes on the named metrics port
whose paths the real metrics server answers as each probe needs, a
termination grace period that covers the drain and the shutdown grace,
Prometheus scraping (annotations, and a ServiceMonitor that selects the
Service's metrics port), a non-root container with a read-only root file
system, and args and env that `jobsignal serve` accepts (parsed by
jobsignal.config itself, so the manifests cannot drift from the code).

Each optional component declares what it is for (COMPONENT_PURPOSES: the
kinds it adds, the fields of which objects it may change); its files, and
its rendered effect on each install, are held to exactly that.

When kubectl is on PATH, `kubectl kustomize` also renders each kustomization
(and each component, and all of them together, on top of each install) and
the rendered objects go through the same checks. The HA component's own
checks are in test_ha.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cache, partial
from itertools import combinations
from pathlib import Path
from typing import Any, NoReturn

# Untyped; installed with kubernetes-validate, which validates with it too.
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import trio
import yaml
from prometheus_client import CollectorRegistry, Gauge

import jobsignal
from jobsignal.config import SERVE_SETTINGS, Config, ConfigError, load_config
from jobsignal.metrics_server import run_metrics_server

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


# --- helpers over objects --------------------------------------------------------


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


# --- the files are there --------------------------------------------------------


def test_deploy_tree_is_complete() -> None:
    expected = [
        DOCKERFILE,
        DEPLOY / "README.md",
        KUBE / "kustomization.yaml",
        KUBE / "base" / "kustomization.yaml",
        KUBE / "base" / "deployment.yaml",
        KUBE / "base" / "rbac.yaml",
        KUBE / "base" / "service.yaml",
        KUBE / "base" / "serviceaccount.yaml",
        KUBE / "overlays" / "namespaced" / "kustomization.yaml",
        KUBE / "components" / "prometheus-operator" / "kustomization.yaml",
        KUBE / "components" / "prometheus-operator" / "servicemonitor.yaml",
        KUBE / "components" / "ha" / "kustomization.yaml",
        KUBE / "components" / "ha" / "poddisruptionbudget.yaml",
        KUBE / "examples" / "sidecar.yaml",
    ]
    missing = [str(p.relative_to(ROOT)) for p in expected if not p.is_file()]
    assert not missing, f"missing: {missing}"
    kinds = {m.kind for m in MANIFESTS}
    assert {"Deployment", "Service", "ServiceAccount", "ClusterRole", "Role"} <= kinds
    assert {"ServiceMonitor", "PodDisruptionBudget"} <= kinds


# --- schemas (offline: the no_network fixture is in conftest.py) -------------------


# The Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), reduced
# to the fields these manifests may use and strict like the Kubernetes check:
# anything else, a misspelt field included, is an error. Field names and types
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
MONITOR_SCHEMAS: dict[str, Obj] = {
    "ServiceMonitor": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": f"{MONITORING_GROUP}/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                    "namespace": {"type": "string"},
                    "labels": _STRING_MAP,
                    "annotations": _STRING_MAP,
                },
            },
            "spec": {
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
        },
    },
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


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("manifest", MANIFESTS, ids=str)
def test_manifest_matches_kubernetes_schema(manifest: Manifest) -> None:
    _validate_schema(manifest.body, str(manifest))


@pytest.mark.usefixtures("no_network")
def test_strict_schema_rejects_unknown_fields() -> None:
    """The validator really is strict: a misspelt field is an error, not ignored."""
    deployment = next(m for m in MANIFESTS if m.kind == "Deployment")
    broken = json.loads(json.dumps(deployment.body))
    _jobsignal_container(broken)["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(
    ("field", "value"),
    [
        (("spec", "endpoints", 0, "prot"), "metrics"),  # misspelt
        (("spec", "selecter"), {}),  # misspelt
        (("spec", "endpoints", 0, "scheme"), "HTTP"),  # not an accepted value
        (("spec", "endpoints", 0, "interval"), "30"),  # not a duration
    ],
)
def test_monitor_schema_is_strict(field: tuple[str | int, ...], value: object) -> None:
    """The own ServiceMonitor schema rejects what the operator's CRD would not take."""
    monitor = next(m for m in MANIFESTS if m.kind == "ServiceMonitor")
    broken = copy.deepcopy(monitor.body)
    _validate_monitoring(broken, "as written")  # the unbroken one passes
    target: Any = broken
    for part in field[:-1]:
        target = target[part]
    target[field[-1]] = value
    with pytest.raises(pytest.fail.Exception, match=str(field[-1])):
        _validate_monitoring(broken, "broken")


@pytest.mark.parametrize("manifest", MANIFESTS, ids=str)
def test_manifest_is_namespace_agnostic(manifest: Manifest) -> None:
    """Namespaces come from kustomize (or `kubectl -n`), never from the files."""
    assert manifest.name, f"{manifest}: no metadata.name"
    assert "namespace" not in manifest.body["metadata"], f"{manifest}: sets metadata.namespace"


# --- kustomizations ----------------------------------------------------------------


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
    # A ServiceMonitor, and the install itself unchanged.
    "prometheus-operator": ComponentPurpose(adds=("ServiceMonitor",)),
    # Several replicas: a PodDisruptionBudget, and the Deployment's replica
    # count and pod spreading.
    "ha": ComponentPurpose(
        adds=("PodDisruptionBudget",),
        changes={
            ("Deployment", "jobsignal"): frozenset(
                {"spec.replicas", "spec.template.spec.topologySpreadConstraints"}
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


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_resources_exist(path: Path) -> None:
    kustomization = _kustomization(path)
    kind = kustomization.get("kind")
    assert kind in KUSTOMIZE_KINDS, f"{path}: kind {kind}"
    assert kustomization.get("apiVersion") == KUSTOMIZE_KINDS[kind], f"{path}: apiVersion"
    if kind == "Component":
        # Optional parts added to an install: the install decides the namespace.
        assert "namespace" not in kustomization, f"{path}: a component sets the namespace"
    deprecated = {"bases", "commonLabels", "patchesStrategicMerge", "patchesJson6902", "vars"}
    assert not deprecated & kustomization.keys(), f"{path}: deprecated kustomize fields"
    resources = kustomization.get("resources", [])
    assert resources, f"{path}: lists no resources"
    for entry in resources:
        target = (path.parent / entry).resolve()
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{path}: {entry} is no kustomization"
            # kustomize refuses an overlay that lies inside the base it uses.
            assert not path.parent.resolve().is_relative_to(target), f"{path}: cycle via {entry}"
        else:
            assert target.is_file(), f"{path}: resource {entry} does not exist"
            assert target.is_relative_to(path.parent.resolve()), f"{path}: {entry} is outside"
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            assert (path.parent / patch["path"]).is_file(), f"{path}: no patch {patch['path']}"


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_patches_hit_a_resource(path: Path) -> None:
    """A kustomization's patches hit its own resources; a component's hit
    those of every install it can be added to as well."""
    own = _kustomize_resources(path.parent)
    starts = [own]
    if _is_component(path.parent):
        starts = [own + _kustomize_resources(root) for root in ROOT_KUSTOMIZATIONS]
    for patch in _kustomization(path).get("patches", []):
        assert "patch" in patch, f"{path}: patches are inline (a patch file is no valid object)"
    for body in _patch_bodies(path.parent):
        target = (body["kind"], body["metadata"]["name"])
        for objects in starts:
            available = {(o["kind"], o["metadata"]["name"]) for o in objects}
            assert target in available, f"{path}: patch for {target} matches no resource"


def test_every_manifest_outside_examples_is_in_a_kustomization() -> None:
    listed: set[Path] = set()
    for path in KUSTOMIZATIONS:
        for entry in _kustomization(path).get("resources", []):
            listed.add((path.parent / entry).resolve())
    orphans = [
        str(path.relative_to(ROOT))
        for path in {m.path for m in MANIFESTS}
        if path.resolve() not in listed and KUBE / "examples" not in path.parents
    ]
    assert not orphans, f"not listed by any kustomization: {sorted(orphans)}"


def test_namespaced_overlay_drops_cluster_rbac_and_watches_own_namespace() -> None:
    overlay = _kustomization(KUBE / "overlays" / "namespaced" / "kustomization.yaml")
    patches = [_documents(p["patch"], "overlay")[0] for p in overlay["patches"]]
    deleted = {p["kind"] for p in patches if p.get("$patch") == "delete"}
    assert deleted == {"ClusterRole", "ClusterRoleBinding"}
    env = [
        e
        for p in patches
        if p["kind"] == "Deployment"
        for c in _containers(_pod_spec(p))
        if c["name"] == "jobsignal"
        for e in c.get("env", [])
    ]
    assert _env_values({"env": env}, "namespaced overlay") == {
        "JOBSIGNAL_NAMESPACES": FIELD_REF_SAMPLES["metadata.namespace"]
    }
    added = _kustomize_resources(KUBE / "overlays" / "namespaced")
    assert {o["kind"] for o in added} >= {"Role", "RoleBinding"}


# --- RBAC ------------------------------------------------------------------------


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


def test_every_role_grants_only_reading_configmaps() -> None:
    roles = [m for m in MANIFESTS if m.kind in RBAC_ROLE_KINDS]
    assert roles
    for manifest in roles:
        _check_rbac([manifest.body], str(manifest))


@pytest.mark.parametrize("install", INSTALLS)
def test_bindings_use_the_own_roles_and_service_accounts(install: str) -> None:
    _check_rbac(INSTALLS[install], install)


# --- labels ------------------------------------------------------------------------


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


@pytest.mark.parametrize("install", INSTALLS)
def test_every_object_carries_the_recommended_labels(install: str) -> None:
    _check_labels(INSTALLS[install], install)


def test_label_check_catches_a_missing_label_and_an_unstable_selector() -> None:
    """The check above is not vacuous."""
    objects = copy.deepcopy(INSTALLS[_rel(KUBE / "base")])
    _check_labels(objects, "as written")
    service = next(o for o in objects if o["kind"] == "Service")
    del service["metadata"]["labels"]["app.kubernetes.io/part-of"]
    with pytest.raises(AssertionError, match=r"lacks.*part-of"):
        _check_labels(objects, "without part-of")
    objects = copy.deepcopy(INSTALLS[_rel(KUBE / "base")])
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    selector["app.kubernetes.io/version"] = jobsignal.__version__
    with pytest.raises(AssertionError, match="version"):
        _check_labels(objects, "version in a selector")


# --- workloads --------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "install",
    [
        name
        for name, objects in INSTALLS.items()
        if any(o["kind"] in WORKLOAD_KINDS for o in objects)
    ],
)
def test_workloads_are_secure_probed_and_configured(install: str) -> None:
    _check_workloads(INSTALLS[install], install)


@pytest.mark.parametrize(
    ("env", "value"), [("JOBSIGNAL_DRAIN_DELAY", "30"), ("JOBSIGNAL_SHUTDOWN_GRACE", "25")]
)
def test_termination_grace_must_cover_a_longer_drain_or_grace(env: str, value: str) -> None:
    """Raising the drain or the grace without terminationGracePeriodSeconds fails the check."""
    objects = copy.deepcopy(INSTALLS[_rel(KUBE / "base")])
    _check_workloads(objects, "as written")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    entries = _jobsignal_container(deployment)["env"]
    entries[:] = [e for e in entries if e["name"] != env] + [{"name": env, "value": value}]
    with pytest.raises(AssertionError, match="terminationGracePeriodSeconds"):
        _check_workloads(objects, f"{env}={value}")


def test_no_setting_collides_with_service_link_variables() -> None:
    """Even with service links on, a Service "jobsignal" could not shadow a setting."""
    service_links = re.compile(r"^JOBSIGNAL_(SERVICE_HOST|SERVICE_PORT|PORT)(_|$)")
    assert not [env for env in ENV_VARS if service_links.match(env)]


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


@pytest.mark.parametrize("install", INSTALLS)
def test_services_target_the_named_container_ports(install: str) -> None:
    _check_services(INSTALLS[install], install)


def test_base_has_exactly_one_service() -> None:
    base = INSTALLS[_rel(KUBE / "base")]
    assert [o["kind"] for o in base if o["kind"] == "Service"] == ["Service"]
    (deployment,) = [o for o in base if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1


def test_sidecar_example_client_talks_to_localhost() -> None:
    objects = INSTALLS[_rel(KUBE / "examples" / "sidecar.yaml")]
    (deployment,) = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    spec = _pod_spec(deployment)
    others = [c for c in spec["containers"] if c["name"] != "jobsignal"]
    assert others, "the example has no client container next to jobsignal"
    for client in others:
        command = " ".join(client.get("args", []) + client.get("command", []))
        assert re.search(rf"\b(localhost|127\.0\.0\.1):{GRPC_PORT}\b", command), command
    # A native sidecar: starts before the client and lives as long as the pod.
    sidecars = [c for c in spec.get("initContainers", []) if c["name"] == "jobsignal"]
    assert [c.get("restartPolicy") for c in sidecars] == ["Always"]
    # gRPC stays inside the pod; from outside only the metrics port is open.
    config = _container_config(deployment, "sidecar")
    assert {host for host, _ in _addresses(config.listen)} <= LOOPBACK_HOSTS
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= _pod_labels(deployment).items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    opened = [port for rule in policy["spec"].get("ingress", []) for port in rule["ports"]]
    assert opened == [{"port": "metrics", "protocol": "TCP"}], opened


# --- Prometheus -----------------------------------------------------------------------


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


def test_every_declared_component_exists() -> None:
    assert sorted(component.name for component in COMPONENTS) == sorted(COMPONENT_PURPOSES)


@pytest.mark.parametrize("component", COMPONENTS, ids=_rel)
def test_each_component_adds_and_patches_only_what_it_is_for(component: Path) -> None:
    """As written: the objects it adds are of the declared kinds, its patches
    hit the declared objects and set only the declared fields, and no install
    has those kinds without it (it really is optional)."""
    purpose = _purpose(component)
    kinds = sorted(o["kind"] for o in _kustomize_resources(component))
    assert kinds == sorted(purpose.adds), f"{_rel(component)} adds {kinds}"
    patched: dict[tuple[str, str], set[str]] = {}
    for body in _patch_bodies(component):
        target = (body["kind"], body["metadata"]["name"])
        patched.setdefault(target, set()).update(_leaf_paths(body))
    assert patched.keys() == purpose.changes.keys(), f"{_rel(component)} patches {set(patched)}"
    for target, paths in patched.items():
        allowed = purpose.changes[target]
        stray = sorted(path for path in paths if not _covered(path, allowed))
        assert not stray, f"{_rel(component)}: patch of {target} sets {stray}"
        assert all(any(_covered(path, {f}) for path in paths) for f in allowed), (target, paths)
    for root in ROOT_KUSTOMIZATIONS:
        present = {o["kind"] for o in INSTALLS[_rel(root)]} & set(purpose.adds)
        assert not present, f"{_rel(root)} has {present} without {_rel(component)}"


def test_component_check_catches_a_stray_field() -> None:
    """The field check above is not vacuous: a patch field outside the declared
    ones, or a declared one the patch does not set, is found."""
    allowed = frozenset({"spec.replicas", "spec.template.spec.topologySpreadConstraints"})
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "jobsignal"},
        "spec": {"replicas": 2, "template": {"spec": {"hostNetwork": True}}},
    }
    paths = _leaf_paths(patch)
    assert paths == {"spec.replicas", "spec.template.spec.hostNetwork"}
    assert [path for path in sorted(paths) if not _covered(path, allowed)] == [
        "spec.template.spec.hostNetwork"
    ]
    assert not _covered("spec.replicasX", allowed)
    before: Obj = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "a"}]}}}}
    after = copy.deepcopy(before)
    after["spec"]["template"]["spec"]["containers"][0]["name"] = "b"
    after["spec"]["paused"] = True
    assert set(_differences(before, after)) == {"spec.paused", "spec.template.spec.containers"}


@pytest.mark.parametrize("install", INSTALLS)
def test_monitors_select_the_service_metrics_port(install: str) -> None:
    _check_monitors(INSTALLS[install], install)


def test_monitor_check_catches_a_wrong_port_and_selector() -> None:
    """The check above is not vacuous."""
    name = next(
        n for n, objects in INSTALLS.items() if any(o["kind"] == "ServiceMonitor" for o in objects)
    )
    objects = copy.deepcopy(INSTALLS[name])
    _check_monitors(objects, "as written")
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["port"] = "grpc"
    with pytest.raises(AssertionError, match="scrapes 'grpc'"):
        _check_monitors(objects, "wrong port")
    monitor["spec"]["endpoints"][0]["port"] = "metrics"
    monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] = "other"
    with pytest.raises(AssertionError, match="selects 0 Services"):
        _check_monitors(objects, "wrong selector")


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


async def test_probe_and_scrape_paths_are_answered_as_each_needs() -> None:
    """Against the real metrics server on 127.0.0.1, before the store is loaded,
    once it is, and while draining: readiness and startup follow the state,
    liveness and /metrics answer throughout."""
    paths = _served_paths()
    assert all(paths.values()), paths
    registry = CollectorRegistry()
    Gauge("jobsignal_probe_test", "A sample to find in the scrape.", registry=registry).set(7)
    not_ready: list[str | None] = ["the job store is not loaded yet (first LIST pending)"]
    answers: dict[str, dict[str, tuple[int, bytes]]] = {}
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(run_metrics_server, readiness=lambda: not_ready[0]),
            "127.0.0.1",
            0,
            registry,
        )
        for state, reason in (("loading", not_ready[0]), ("ready", None), ("draining", "x")):
            not_ready[0] = reason
            answers[state] = {path: await _get(port, path) for path in set().union(*paths.values())}
        nursery.cancel_scope.cancel()

    def status(state: str, path: str) -> int:
        return answers[state][path][0]

    for path in paths["readinessProbe"] | paths["startupProbe"]:
        # Startup too: it must hold the pod (and a sidecar's client) back
        # until the first LIST is loaded.
        assert [status(s, path) for s in ("loading", "ready")] == [503, 200], path
    for path in paths["readinessProbe"]:
        assert status("draining", path) == 503, path
    for path in paths["livenessProbe"]:
        # Neither a slow first LIST nor the drain may get the pod killed.
        assert [status(s, path) for s in answers] == [200, 200, 200], path
    for path in paths["metrics"]:
        for state in answers:
            code, body = answers[state][path]
            assert code == 200 and b"jobsignal_probe_test 7.0" in body, (state, path, body)


# --- the Dockerfile -------------------------------------------------------------


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


def _exec_form(arguments: str, instruction: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), f"{instruction} must use the exec (JSON) form"
    return [str(part) for part in value]


def test_dockerfile() -> None:
    steps = _dockerfile_instructions(DOCKERFILE.read_text())
    first = [args for keyword, args in steps if keyword == "FROM"]
    assert len(first) == 1 and first[0].startswith("python:3.11-slim"), first

    def last(keyword: str) -> str:
        found = [args for kw, args in steps if kw == keyword]
        assert found, f"Dockerfile has no {keyword}"
        return found[-1]

    user = last("USER").split(":")
    assert user[0].isdigit() and int(user[0]) == UID, f"USER {user} must be numeric {UID}"
    assert all(part.isdigit() and int(part) != 0 for part in user), "USER must not be root"
    assert str(GRPC_PORT) in last("EXPOSE").split()

    entrypoint = _exec_form(last("ENTRYPOINT"), "ENTRYPOINT")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["jobsignal"] and "jobsignal" in scripts
    config = _serve_config(_exec_form(last("CMD"), "CMD"), {}, "Dockerfile CMD")
    assert config.source == "kubernetes"

    env = " ".join(args for keyword, args in steps if keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env.split()
    copied = [args.split()[:-1] for keyword, args in steps if keyword == "COPY"]
    assert sorted(src for sources in copied for src in sources) == [
        "README.md",
        "jobsignal/",
        "pyproject.toml",
    ]
    runs = [args for keyword, args in steps if keyword == "RUN"]
    assert any(re.search(r"pip install --no-cache-dir .* \.(\s|$)", run) for run in runs), runs


def test_dockerignore_keeps_what_the_image_copies() -> None:
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!jobsignal/"} <= set(patterns)


# --- rendered by kustomize, where kubectl is available -----------------------------


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


@needs_kubectl
@pytest.mark.parametrize("directory", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_kustomize_build(directory: Path) -> None:
    objects = _plain_build(directory)
    _check_rendered(objects, f"kustomize build {_rel(directory)}")
    optional = {kind for purpose in COMPONENT_PURPOSES.values() for kind in purpose.adds}
    present = optional & {o["kind"] for o in objects}
    assert not present, f"{present} belong to optional components"
    if directory.name == "namespaced":
        assert not {"ClusterRole", "ClusterRoleBinding"} & {o["kind"] for o in objects}


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


@needs_kubectl
@pytest.mark.parametrize(
    "components", _component_sets(), ids=lambda cs: "+".join(c.name for c in cs)
)
@pytest.mark.parametrize("directory", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_kustomize_build_with_components_in_own_overlay(
    directory: Path, components: tuple[Path, ...], tmp_path: Path
) -> None:
    """Each install with each component, and with several together, added in an
    operator's own overlay: checked like the install, and for what each adds."""
    objects = _render_with(directory, components, tmp_path)
    _check_with_components(directory, objects, components, _install_name(directory, components))


@needs_kubectl
@pytest.mark.parametrize("directory", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_kustomize_build_with_the_commented_component_line(directory: Path, tmp_path: Path) -> None:
    """The `components:` lines left commented in each install work once uncommented."""
    copied = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copied)
    kustomization = copied / directory.relative_to(KUBE) / "kustomization.yaml"
    text = kustomization.read_text()
    hint = re.search(r"^# components:\n(#   - .+\n)+", text, re.MULTILINE)
    assert hint, f"{_rel(directory)}: no commented components: lines"
    uncommented = re.sub(r"^# ?", "", hint.group(0), flags=re.MULTILINE)
    kustomization.write_text(text.replace(hint.group(0), uncommented))
    # Every component is offered there, and the listed paths are the components.
    listed = _kustomization(kustomization)["components"]
    components = [(directory / entry).resolve() for entry in listed]
    assert sorted(components) == sorted(c.resolve() for c in COMPONENTS), listed
    where = f"{_rel(directory)}, uncommented"
    _check_with_components(directory, _render(kustomization.parent), components, where)
