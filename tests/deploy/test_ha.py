"""The HA component, deploy/kubernetes/components/ha: several replicas behind one Service.

What several replicas need from the manifests: two of them (the base stays at
one), a PodDisruptionBudget that selects exactly the Deployment's pods and
lets one of them go at a time, and topology spread over nodes (hard) and
zones (a preference) that counts those same pods.

As written, the component's budget and patch are checked offline, applied to
the base's Deployment field by field (only the fields COMPONENT_PURPOSES in
test_manifests.py allows it to set). Rendered by `kubectl kustomize` into
each install, alone and together with the prometheus-operator component, the
objects are validated against the Kubernetes schemas in strict mode with the
network blocked, checked like every install, for what each component adds
and changes, and for the above.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobsignal.config import load_config
from tests.support.manifests import (
    COMPONENT_PURPOSES,
    KUBE,
    ROOT_KUSTOMIZATIONS,
    STABLE_LABELS,
    WORKLOAD_KINDS,
    Obj,
    _check_with_components,
    _install_name,
    _kustomize_resources,
    _patch_bodies,
    _pod_labels,
    _pod_spec,
    _rel,
    _render_with,
    _validate_schema,
    needs_kubectl,
)

HA = KUBE / "components" / "ha"
PROMETHEUS_OPERATOR = KUBE / "components" / "prometheus-operator"
BASE_DEPLOYMENT = KUBE / "base" / "deployment.yaml"
REPLICAS = 2
# How the replicas spread: never two on one node while another eligible node
# has none; across zones as far as the cluster allows, never left Pending for it.
SPREAD = {
    "kubernetes.io/hostname": "DoNotSchedule",
    "topology.kubernetes.io/zone": "ScheduleAnyway",
}
# Added to each pod by the Deployment controller, per ReplicaSet: spreading by
# it counts a rollout's new pods among themselves.
CONTROLLER_LABEL_KEYS = frozenset({"pod-template-hash"})


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    match_labels = selector.get("matchLabels", {})
    assert not selector.get("matchExpressions"), f"matchExpressions in {selector}"
    return bool(match_labels) and match_labels.items() <= labels.items()


def _check_ha(objects: Sequence[Obj], where: str) -> None:
    """Two replicas, a budget over exactly their pods that lets one go, spread by their labels."""
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    replicas = deployment["spec"]["replicas"]
    assert replicas == REPLICAS, f"{where}: {replicas} replicas"
    pods = deployment["spec"]["selector"]
    pod_labels = _pod_labels(deployment)

    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == 1, f"{where}: {len(budgets)} PodDisruptionBudgets"
    (budget,) = budgets
    here = f"{where}: PodDisruptionBudget/{budget['metadata']['name']}"
    assert budget["apiVersion"] == "policy/v1", f"{here}: {budget['apiVersion']}"
    namespace = budget["metadata"].get("namespace")
    assert namespace == deployment["metadata"].get("namespace"), f"{here}: in {namespace}"
    # Exactly the Deployment's pods: its own selector (a narrower one would
    # miss some, a broader one would count another install's pods), and no
    # other workload of the install.
    selector = budget["spec"]["selector"]
    assert selector == pods, f"{here}: selects {selector}, the Deployment's pods are {pods}"
    assert set(selector["matchLabels"]) == STABLE_LABELS, f"{here}: {selector}"
    selected = [
        o for o in objects if o["kind"] in WORKLOAD_KINDS and _selects(selector, _pod_labels(o))
    ]
    assert selected == [deployment], f"{here}: selects {len(selected)} workloads"
    # One replica may go at a time; minAvailable == replicas would block every drain.
    assert "maxUnavailable" not in budget["spec"], f"{here}: maxUnavailable and minAvailable"
    available = budget["spec"].get("minAvailable")
    assert isinstance(available, int), f"{here}: minAvailable {available!r} (a count)"
    assert 1 <= available < replicas, f"{here}: minAvailable {available} of {replicas}"

    # A rollout never leaves a moment without a serving replica: a new pod first,
    # Ready (its first LIST loaded) before an old one stops, which drains.
    strategy = deployment["spec"].get("strategy", {})
    rolling = strategy.get("rollingUpdate", {})
    assert strategy.get("type") == "RollingUpdate", f"{where}: strategy {strategy}"
    assert rolling.get("maxUnavailable") == 0, f"{where}: rollout {rolling}"
    assert rolling.get("maxSurge", 0) not in (0, "0%"), f"{where}: rollout {rolling}"
    (container,) = _pod_spec(deployment)["containers"]
    probe = container.get("readinessProbe", {})
    assert probe.get("httpGet", {}).get("path") == "/readyz", f"{where}: readiness {probe}"
    _check_max_connection_age(container, where)

    constraints = _pod_spec(deployment).get("topologySpreadConstraints", [])
    spread = {c["topologyKey"]: c["whenUnsatisfiable"] for c in constraints}
    assert spread == SPREAD and len(constraints) == len(SPREAD), f"{where}: spread {constraints}"
    for constraint in constraints:
        there = f"{where}: spread over {constraint['topologyKey']}"
        # The pods' own stable labels: the constraint counts this install's replicas.
        assert constraint["labelSelector"] == pods, f"{there}: {constraint['labelSelector']}"
        assert _selects(constraint["labelSelector"], pod_labels), f"{there}: not the pod labels"
        keys = set(constraint.get("matchLabelKeys", []))
        assert keys <= CONTROLLER_LABEL_KEYS | pod_labels.keys(), f"{there}: matchLabelKeys {keys}"
        assert constraint["maxSkew"] == 1, f"{there}: maxSkew {constraint['maxSkew']}"
        if constraint["whenUnsatisfiable"] == "DoNotSchedule":
            # A node whose taint the pod does not tolerate (control plane,
            # cordoned) must not count as an empty domain, or on one worker
            # the second replica would stay Pending.
            assert constraint.get("nodeTaintsPolicy") == "Honor", f"{there}: nodeTaintsPolicy"


def _set(obj: Obj, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = copy.deepcopy(value)


def _get(obj: Obj, path: str, where: str) -> Any:
    for part in path.split("."):
        if part not in obj:
            pytest.fail(f"{where} does not set {path}", pytrace=False)
        obj = obj[part]
    return obj


def _as_written(root: Path) -> list[Obj]:
    """An install with the component applied offline: its objects added, and
    each field it declares copied from its patch onto the target."""
    objects = copy.deepcopy(_kustomize_resources(root)) + copy.deepcopy(_kustomize_resources(HA))
    changes = COMPONENT_PURPOSES[HA.name].changes
    for patch in _patch_bodies(HA):
        target = (patch["kind"], patch["metadata"]["name"])
        (obj,) = [o for o in objects if (o["kind"], o["metadata"]["name"]) == target]
        for path in changes[target]:
            value = _get(patch, path, f"{_rel(HA)}: the patch of {target}")
            if path == CONTAINERS:
                value = _merged_by_name(_get(obj, path, str(target)), value)
            _set(obj, path, value)
    return objects


CONTAINERS = "spec.template.spec.containers"


def _merged_by_name(base: list[Obj], patch: list[Obj]) -> list[Obj]:
    """A strategic merge of containers, and of each one's env, by name (as kustomize does)."""
    merged = copy.deepcopy(base)
    for patched in patch:
        (container,) = [c for c in merged if c["name"] == patched["name"]]
        for key, value in patched.items():
            if key == "env":
                names = {e["name"] for e in value}
                kept = [e for e in container.get("env", []) if e["name"] not in names]
                container["env"] = kept + value
            elif key != "name":
                container[key] = value
    return merged


# --- as written ------------------------------------------------------------------


def test_base_keeps_one_replica_and_points_at_the_component() -> None:
    (deployment,) = [o for o in _kustomize_resources(KUBE / "base") if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1
    text = BASE_DEPLOYMENT.read_text()
    comment = text[: text.index("\n  replicas:")].rpartition("spec:\n")[2]
    assert "components/ha" in comment, (
        f"the replicas comment does not name the component: {comment}"
    )
    assert (HA / "kustomization.yaml").is_file()


@pytest.mark.parametrize("root", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_component_as_written_gives_each_install_what_ha_needs(root: Path) -> None:
    _check_ha(_as_written(root), f"{_rel(root)} + ha, as written")


@pytest.mark.usefixtures("no_network")
def test_component_objects_as_written_match_the_schemas() -> None:
    objects = _as_written(KUBE / "base")
    for obj in objects:
        if obj["kind"] in ("Deployment", "PodDisruptionBudget"):
            _validate_schema(obj, f"as written: {obj['kind']}/{obj['metadata']['name']}")


def _budget(objects: list[Obj]) -> Obj:
    (budget,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    return budget


def _constraint(objects: list[Obj], key: str) -> Obj:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    constraints: list[Obj] = _pod_spec(deployment)["topologySpreadConstraints"]
    (found,) = [c for c in constraints if c["topologyKey"] == key]
    return found


def _label(selector: Obj, key: str, value: str) -> None:
    selector["matchLabels"][f"app.kubernetes.io/{key}"] = value


BREAKAGES: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "one replica": (
        lambda objects: _set(
            next(o for o in objects if o["kind"] == "Deployment"), "spec.replicas", 1
        ),
        "1 replicas",
    ),
    "budget of another instance": (
        lambda objects: _label(_budget(objects)["spec"]["selector"], "instance", "other"),
        "selects",
    ),
    "budget broader than the Deployment": (
        lambda objects: _budget(objects)["spec"]["selector"]["matchLabels"].pop(
            "app.kubernetes.io/instance"
        ),
        "selects",
    ),
    "budget that blocks every drain": (
        lambda objects: _set(_budget(objects), "spec.minAvailable", REPLICAS),
        "minAvailable 2 of 2",
    ),
    "budget as a percentage": (
        lambda objects: _set(_budget(objects), "spec.minAvailable", "50%"),
        "a count",
    ),
    "spread over other pods": (
        lambda objects: _label(
            _constraint(objects, "kubernetes.io/hostname")["labelSelector"], "name", "other"
        ),
        "spread over kubernetes.io/hostname",
    ),
    "zones made a hard rule": (
        lambda objects: _set(
            _constraint(objects, "topology.kubernetes.io/zone"),
            "whenUnsatisfiable",
            "DoNotSchedule",
        ),
        "spread",
    ),
    "tainted nodes counted": (
        lambda objects: _constraint(objects, "kubernetes.io/hostname").pop("nodeTaintsPolicy"),
        "nodeTaintsPolicy",
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_ha_check_catches(breakage: str) -> None:
    """The check above is not vacuous: each way of getting it wrong is found."""
    objects = _as_written(KUBE / "base")
    _check_ha(objects, "as written")
    spoil, message = BREAKAGES[breakage]
    spoil(objects)
    with pytest.raises(AssertionError, match=message):
        _check_ha(objects, breakage)


# --- rendered by kustomize, where kubectl is available -----------------------------


@needs_kubectl
@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(
    "components",
    [(HA,), (HA, PROMETHEUS_OPERATOR)],
    ids=lambda components: "+".join(c.name for c in components),
)
@pytest.mark.parametrize("root", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_component_builds_into_each_install(
    root: Path, components: tuple[Path, ...], tmp_path: Path
) -> None:
    """`kubectl kustomize` with the component in an operator's own overlay
    (alone, and with the ServiceMonitor too): every object valid against the
    Kubernetes schemas (strict, offline), the install's checks, only what the
    components declare added and changed, and what several replicas need."""
    where = _install_name(root, components)
    objects = _render_with(root, components, tmp_path)
    for obj in objects:
        _validate_schema(obj, f"{where}: {obj['kind']}/{obj['metadata']['name']}")
    _check_with_components(root, objects, components, where)
    _check_ha(objects, where)
    if PROMETHEUS_OPERATOR in components:
        assert [o["kind"] for o in objects].count("ServiceMonitor") == 1, where


def _check_max_connection_age(container: Mapping[str, Any], where: str) -> None:
    """The component adds a maximum connection age to the environment, keeping the
    base's; no grace, so no live subscription is ever ended for it."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    (base_container,) = _pod_spec(_base_deployment())["containers"]
    base_env = {e["name"]: e.get("value") for e in base_container.get("env", [])}
    aging = {name: value for name, value in env.items() if "MAX_CONNECTION_AGE" in name}
    assert aging == {"JOBSIGNAL_MAX_CONNECTION_AGE": "3600"}, f"{where}: env {aging}"
    assert {name: env[name] for name in base_env} == base_env, f"{where}: env changed"
    config = load_config({}, {k: v for k, v in env.items() if isinstance(v, str)})
    assert config.max_connection_age == 3600.0, where
    assert config.max_connection_age_grace is None, f"{where}: a grace ends subscriptions"


def _base_deployment() -> Obj:
    (deployment,) = [
        o for o in yaml.safe_load_all(BASE_DEPLOYMENT.read_text()) if o["kind"] == "Deployment"
    ]
    found: Obj = deployment
    return found
