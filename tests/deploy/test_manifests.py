"""Offline checks of deploy/: Kubernetes schemas, RBAC, probes, security and settings drift.

Every YAML document under deploy/kubernetes (base, overlays, examples) is
validated against the Kubernetes OpenAPI schemas bundled with the
kubernetes-validate package, in strict mode (unknown fields are errors), with
the network blocked. kustomization.yaml files are not Kubernetes objects: they
are checked for resources that exist and patches that hit something instead.

The rest pins what deploy/README.md promises: RBAC that reads ConfigMaps and
nothing else, gRPC probes on 8899, a non-root container with a read-only root
file system, and args and env that `jobsignal serve` accepts (parsed by
jobsignal.config itself, so the manifests cannot drift from the code).

When kubectl is on PATH, `kubectl kustomize` also renders each kustomization
and the rendered objects go through the same checks.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import kubernetes_validate
import pytest
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
UID = 10001
IMAGE = "jobsignal"
KUSTOMIZATION_NAMES = frozenset({"kustomization.yaml", "kustomization.yml", "Kustomization"})
WORKLOAD_KINDS = frozenset({"Deployment", "Pod"})
RBAC_ROLE_KINDS = frozenset({"Role", "ClusterRole"})
RBAC_BINDING_KINDS = frozenset({"RoleBinding", "ClusterRoleBinding"})
READ_VERBS = frozenset({"get", "list", "watch"})

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
        KUBE / "examples" / "sidecar.yaml",
    ]
    missing = [str(p.relative_to(ROOT)) for p in expected if not p.is_file()]
    assert not missing, f"missing: {missing}"
    kinds = {m.kind for m in MANIFESTS}
    assert {"Deployment", "Service", "ServiceAccount", "ClusterRole", "Role"} <= kinds


# --- schemas ----------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to resolve or connect fails the test: validation must be offline."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError(f"network access during schema validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _validate_schema(body: Obj, where: str) -> None:
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


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_resources_exist(path: Path) -> None:
    kustomization = _kustomization(path)
    assert kustomization.get("kind") == "Kustomization"
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
    available = {(o["kind"], o["metadata"]["name"]) for o in _kustomize_resources(path.parent)}
    for patch in _kustomization(path).get("patches", []):
        assert "patch" in patch, f"{path}: patches are inline (a patch file is no valid object)"
        body = _documents(patch["patch"], str(path))[0]
        target = (body["kind"], body["metadata"]["name"])
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


def _by_file() -> dict[Path, list[Obj]]:
    """The objects that are installed together: a kustomization tree, or one example file."""
    groups: dict[Path, list[Obj]] = {}
    for path in KUSTOMIZATIONS:
        groups[path.parent] = _kustomize_resources(path.parent)
    for manifest in MANIFESTS:
        if KUBE / "examples" in manifest.path.parents:
            groups.setdefault(manifest.path, []).append(manifest.body)
    return groups


INSTALLS = _by_file()


def test_every_role_grants_only_reading_configmaps() -> None:
    roles = [m for m in MANIFESTS if m.kind in RBAC_ROLE_KINDS]
    assert roles
    for manifest in roles:
        _check_rbac([manifest.body], str(manifest))


@pytest.mark.parametrize("install", INSTALLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bindings_use_the_own_roles_and_service_accounts(install: Path) -> None:
    _check_rbac(INSTALLS[install], str(install.relative_to(ROOT)))


# --- workloads --------------------------------------------------------------------


def _check_workloads(objects: Sequence[Obj], where: str) -> None:
    """Probes, security, resources and the serve configuration of every workload."""
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

    config = _serve_config(container.get("args", []), _env_values(container, here), here)
    assert config.source == "kubernetes", f"{here}: must not fall back to the demo cluster"
    assert config.log_format == "json", f"{here}: logs must be JSON lines"
    assert config.listen[1] == GRPC_PORT, f"{here}: listens on {config.listen}"

    ports = container.get("ports", [])
    assert {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"} in ports, here

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        assert probe is not None, f"{here}: no {kind}"
        handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & probe.keys()
        assert handlers == {"grpc"}, f"{here}: {kind} must be a gRPC probe, not {handlers}"
        # Port 8899, overall health ("" service): the only entry that turns
        # SERVING once the first LIST is loaded and stays so.
        assert probe["grpc"] == {"port": GRPC_PORT}, f"{here}: {kind}.grpc {probe['grpc']}"

    # Liveness must not kill a pod whose first LIST is slow: the startup probe
    # holds liveness back and gives the first LIST minutes; liveness itself
    # tolerates a minute of missed answers.
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, f"{here}: startup"
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60, f"{here}: liveness"


@pytest.mark.parametrize(
    "install",
    [p for p in INSTALLS if any(o["kind"] in WORKLOAD_KINDS for o in INSTALLS[p])],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_workloads_are_secure_probed_and_configured(install: Path) -> None:
    _check_workloads(INSTALLS[install], str(install.relative_to(ROOT)))


def test_no_setting_collides_with_service_link_variables() -> None:
    """Even with service links on, a Service "jobsignal" could not shadow a setting."""
    service_links = re.compile(r"^JOBSIGNAL_(SERVICE_HOST|SERVICE_PORT|PORT)(_|$)")
    assert not [env for env in ENV_VARS if service_links.match(env)]


def _check_services(objects: Sequence[Obj], where: str) -> None:
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    services = [o for o in objects if o["kind"] == "Service"]
    for service in services:
        here = f"{where}: Service/{service['metadata']['name']}"
        spec = service["spec"]
        assert spec.get("type", "ClusterIP") == "ClusterIP", here
        selector = spec["selector"]
        selected = [w for w in workloads if selector.items() <= _pod_labels(w).items() and selector]
        assert len(selected) == 1, f"{here}: selector {selector} matches {len(selected)} pods"
        container = _jobsignal_container(selected[0])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert spec["ports"], here
        for port in spec["ports"]:
            assert port["name"] == "grpc" and port["appProtocol"] == "grpc", here
            assert port["port"] == GRPC_PORT, here
            target = port.get("targetPort", port["port"])
            resolved = named.get(target) if isinstance(target, str) else target
            assert resolved == GRPC_PORT, f"{here}: targetPort {target!r} is no grpc port"


@pytest.mark.parametrize("install", INSTALLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_services_target_the_grpc_container_port(install: Path) -> None:
    _check_services(INSTALLS[install], str(install.relative_to(ROOT)))


def test_base_has_exactly_one_service() -> None:
    base = INSTALLS[KUBE / "base"]
    assert [o["kind"] for o in base if o["kind"] == "Service"] == ["Service"]
    (deployment,) = [o for o in base if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1


def test_sidecar_example_client_talks_to_localhost() -> None:
    (deployment,) = [
        o for o in INSTALLS[KUBE / "examples" / "sidecar.yaml"] if o["kind"] in WORKLOAD_KINDS
    ]
    spec = _pod_spec(deployment)
    others = [c for c in spec["containers"] if c["name"] != "jobsignal"]
    assert others, "the example has no client container next to jobsignal"
    for client in others:
        command = " ".join(client.get("args", []) + client.get("command", []))
        assert re.search(rf"\b(localhost|127\.0\.0\.1):{GRPC_PORT}\b", command), command
    # A native sidecar: starts before the client and lives as long as the pod.
    sidecars = [c for c in spec.get("initContainers", []) if c["name"] == "jobsignal"]
    assert [c.get("restartPolicy") for c in sidecars] == ["Always"]


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


def _root_kustomizations() -> Iterator[Path]:
    """Kustomization directories that are installed (not only used as a base)."""
    bases = {
        (path.parent / entry).resolve()
        for path in KUSTOMIZATIONS
        for entry in _kustomization(path).get("resources", [])
    }
    for path in KUSTOMIZATIONS:
        if path.parent.resolve() not in bases:
            yield path.parent


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize(
    "directory", list(_root_kustomizations()), ids=lambda p: str(p.relative_to(ROOT))
)
def test_kustomize_build(directory: Path) -> None:
    objects = _render(directory)
    where = f"kustomize build {directory.relative_to(ROOT)}"
    for obj in objects:
        _validate_schema(obj, f"{where}: {obj['kind']}/{obj['metadata']['name']}")
    _check_rbac(objects, where)
    _check_workloads(objects, where)
    _check_services(objects, where)
    namespaces = {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]}
    assert len(namespaces) == 1, f"{where}: objects in {namespaces}"
    for binding in (o for o in objects if o["kind"] in RBAC_BINDING_KINDS):
        assert {s["namespace"] for s in binding["subjects"]} == namespaces, binding
    if directory.name == "namespaced":
        assert not {"ClusterRole", "ClusterRoleBinding"} & {o["kind"] for o in objects}
