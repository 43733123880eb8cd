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
import re
import shutil
import tomllib
from functools import partial
from pathlib import Path
from typing import Any

# Untyped; installed with kubernetes-validate, which validates with it too.
import kubernetes_validate
import pytest
import trio
from prometheus_client import CollectorRegistry, Gauge

import jobsignal
from jobsignal.cli import build_parser
from jobsignal.config import parse_listen
from jobsignal.metrics_server import run_metrics_server
from tests.support.manifests import (
    COMPONENT_PURPOSES,
    COMPONENTS,
    DEPLOY,
    DOCKERFILE,
    ENV_VARS,
    FIELD_REF_SAMPLES,
    GRPC_PORT,
    INSTALLS,
    K8S_VERSIONS,
    KUBE,
    KUSTOMIZATIONS,
    KUSTOMIZE_KINDS,
    LOOPBACK_HOSTS,
    MANIFESTS,
    RBAC_ROLE_KINDS,
    ROOT,
    ROOT_KUSTOMIZATIONS,
    UID,
    WORKLOAD_KINDS,
    Manifest,
    Obj,
    _addresses,
    _check_labels,
    _check_monitors,
    _check_rbac,
    _check_rendered,
    _check_services,
    _check_with_components,
    _check_workloads,
    _component_sets,
    _container_config,
    _containers,
    _covered,
    _differences,
    _dockerfile_env,
    _dockerfile_instructions,
    _dockerfile_stages,
    _documents,
    _env_values,
    _exec_form,
    _expand,
    _get,
    _install_name,
    _is_component,
    _jobsignal_container,
    _kustomization,
    _kustomize_resources,
    _leaf_paths,
    _patch_bodies,
    _plain_build,
    _pod_labels,
    _pod_spec,
    _purpose,
    _rel,
    _render,
    _render_with,
    _serve_config,
    _served_paths,
    _validate_monitoring,
    _validate_schema,
    needs_kubectl,
)


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


def test_every_role_grants_only_reading_configmaps() -> None:
    roles = [m for m in MANIFESTS if m.kind in RBAC_ROLE_KINDS]
    assert roles
    for manifest in roles:
        _check_rbac([manifest.body], str(manifest))


@pytest.mark.parametrize("install", INSTALLS)
def test_bindings_use_the_own_roles_and_service_accounts(install: str) -> None:
    _check_rbac(INSTALLS[install], install)


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


def test_dockerfile() -> None:
    global_args, stages = _dockerfile_stages(_dockerfile_instructions(DOCKERFILE.read_text()))
    assert len(stages) == 2, "a build stage and the final image"
    build, final = stages
    # Both stages on the one base, pinned by digest.
    base, digest = global_args["BASE_IMAGE"], global_args["BASE_DIGEST"]
    assert base.startswith("python:3.11-slim") and "@" not in base, base
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), digest
    froms = [_expand(stage[0][1], global_args).split() for stage in stages]
    assert froms == [[f"{base}@{digest}", "AS", "build"], [f"{base}@{digest}"]], froms

    def last(keyword: str) -> str:
        found = [args for kw, args in final if kw == keyword]
        assert found, f"the final stage has no {keyword}"
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

    # The build stage installs from exactly the sources .dockerignore lets in.
    copied = [args.split()[:-1] for keyword, args in build if keyword == "COPY"]
    assert sorted(src for sources in copied for src in sources) == [
        "README.md",
        "jobsignal/",
        "pyproject.toml",
    ]
    # (Each RUN with its blanks, continuation lines' included, made single spaces.)
    build_runs = [" ".join(args.split()) for keyword, args in build if keyword == "RUN"]
    venv = "/opt/jobsignal"
    assert any(f"-m venv --without-pip {venv}" in run for run in build_runs), build_runs
    assert any(
        re.search(rf"pip --python {venv}/bin/python install --no-cache-dir .* \.(\s|$)", run)
        for run in build_runs
    ), build_runs

    # The final image takes the venv alone from the build stage, installs nothing
    # and removes the base's pip.
    final_copies = [args.split() for keyword, args in final if keyword in ("COPY", "ADD")]
    assert final_copies == [["--from=build", venv, venv]], final_copies
    runs = [" ".join(args.split()) for keyword, args in final if keyword == "RUN"]
    assert not [run for run in runs if re.search(r"pip\S* install", run)], runs
    assert any(re.search(r"pip uninstall --yes pip\b", run) for run in runs), runs
    env = _dockerfile_env(final)
    assert env["PATH"].split(":")[0] == f"{venv}/bin", env["PATH"]
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert not {name for name in env if name.startswith("PIP_")}, env
    # The read-only container never writes bytecode, and python:*-slim has none
    # for its standard library: it is compiled in the image, at the -O level the
    # server runs with (a .pyc of another level is not used), by the venv's Python
    # (whose purelib is the venv's site-packages).
    level = int(env.get("PYTHONOPTIMIZE", "0"))
    compile_flags = {
        match.group(1) or ""
        for run in runs
        for match in re.finditer(rf"{venv}/bin/python (-O+ )?-m compileall", run)
    }
    assert compile_flags == {("-" + "O" * level + " ") if level else ""}, compile_flags
    compiled = " ".join(run for run in runs if "compileall" in run)
    assert 'get_path("stdlib")' in compiled and 'get_path("purelib")' in compiled, compiled


def test_dockerfile_labels_the_image_as_oci_says() -> None:
    global_args, stages = _dockerfile_stages(_dockerfile_instructions(DOCKERFILE.read_text()))
    final = stages[-1]
    stage_args = dict(global_args)
    for keyword, arguments in final:
        if keyword == "ARG":
            name, equals, default = arguments.partition("=")
            if equals:
                stage_args[name] = default
            else:  # a global ARG brought into the stage
                assert name in global_args, f"ARG {name} has no value"
    labels: dict[str, str] = {}
    for keyword, arguments in final:
        if keyword == "LABEL":
            for key, value in re.findall(r'(\S+)="([^"]*)"', arguments):
                labels[key] = _expand(value, stage_args)
    oci = "org.opencontainers.image."
    assert {key.removeprefix(oci): value for key, value in labels.items()} == {
        "title": "jobsignal",
        "description": labels[oci + "description"],
        "licenses": "Apache-2.0",
        "version": jobsignal.__version__,
        "revision": "unknown",
        "created": "unknown",
        "base.name": global_args["BASE_IMAGE"],
        "base.digest": global_args["BASE_DIGEST"],
    }
    assert labels[oci + "description"]
    license_text = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert (
        license_text == {"text": labels[oci + "licenses"]}
        or license_text == labels[oci + "licenses"]
    )


def test_readme_builds_the_image_for_amd64_and_arm64() -> None:
    """The documented line builds both platforms from this Dockerfile, and the
    Dockerfile's own comment says the same."""
    for text in (DEPLOY / "README.md").read_text(), DOCKERFILE.read_text():
        joined = re.sub(r"\\\n#?\s*", " ", text)
        builds = [line for line in joined.splitlines() if "docker buildx build" in line]
        assert builds, "no `docker buildx build` line"
        for line in builds:
            assert "-f deploy/Dockerfile" in line, line
            platforms = re.search(r"--platform[ =](\S+)", line)
            assert platforms, line
            assert set(platforms.group(1).split(",")) == {"linux/amd64", "linux/arm64"}, line
            assert line.rstrip().endswith(" ."), f"build from the repository root: {line}"


def test_dockerignore_keeps_what_the_image_copies() -> None:
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!jobsignal/"} <= set(patterns)


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


def _documented_probes() -> dict[str, Obj]:
    """The probe snippets of deploy/README.md's "Probes" section, by handler."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Probes\n") : text.index("## Shutdown\n")]
    probes: dict[str, Obj] = {}
    for block in re.findall(r"```yaml\n(.*?)```", section, re.DOTALL):
        (doc,) = _documents(block, "deploy/README.md")
        for kind, probe in doc.items():
            assert kind.endswith("Probe"), kind
            (handler,) = {"grpc", "httpGet", "exec", "tcpSocket"} & probe.keys()
            probes[handler] = {kind: probe}
    return probes


@pytest.mark.usefixtures("no_network")
def test_the_documented_cheap_and_mutual_tls_probes_work() -> None:
    """The kubelet's gRPC probe (no metrics port) and the exec probe (mutual TLS)
    that deploy/README.md recommends are valid Kubernetes on both schema
    versions, aim at the gRPC port, and the exec one is a `jobsignal check` the
    command line accepts, over TLS, on loopback."""
    probes = _documented_probes()
    assert probes.keys() == {"grpc", "exec"}, probes.keys()
    deployment = next(m for m in MANIFESTS if m.kind == "Deployment")
    for handler, snippet in probes.items():
        body = copy.deepcopy(deployment.body)
        container = _jobsignal_container(body)
        container.pop("readinessProbe")
        container.update(snippet)
        _validate_schema(body, f"deploy/README.md {handler} probe")
    grpc = probes["grpc"]["readinessProbe"]["grpc"]
    assert grpc["port"] == GRPC_PORT and grpc.get("service", "") == ""
    command = probes["exec"]["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["jobsignal", "check"], command
    args = build_parser().parse_args(command[1:])
    assert args.command == "check" and args.tls_ca and args.tls_cert and args.tls_key
    host, port = parse_listen(args.target)
    assert host in LOOPBACK_HOSTS and port == GRPC_PORT
    # The process it starts: its period must leave it room.
    assert probes["exec"]["readinessProbe"]["periodSeconds"] >= 10
