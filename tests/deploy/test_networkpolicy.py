"""components/networkpolicy: who may reach jobsignal's ports.

Port 8899 serves plain-text gRPC whose events carry rank tables (node names,
serial numbers, every NPU's device IP). The component admits labelled client
pods (`jobsignal-client: "true"`, any namespace) to gRPC and the namespace
"monitoring" to the metrics port, and nothing else. Its policy is evaluated
here as Kubernetes evaluates NetworkPolicy ingress (peers, selectors, named
ports), for the peers that matter, as written and rendered into each install;
schemas, labels and what the component may add are test_manifests.py's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.support.manifests import (
    COMPONENTS,
    INSTALLS,
    KUBE,
    ROOT_KUSTOMIZATIONS,
    WORKLOAD_KINDS,
    Obj,
    _install_name,
    _jobsignal_container,
    _pod_labels,
    _rel,
    _render_with,
    needs_kubectl,
)

COMPONENT = KUBE / "components" / "networkpolicy"
CLIENT_LABEL = {"jobsignal-client": "true"}
MONITORING = "monitoring"
INSTALL_NAMESPACE = "jobsignal"


def _matches(selector: Mapping[str, object], labels: Mapping[str, str]) -> bool:
    """A label selector against labels (an empty selector matches everything)."""
    assert not selector.get("matchExpressions"), "matchExpressions are not evaluated here"
    wanted = selector.get("matchLabels", {})
    assert isinstance(wanted, dict)
    return all(labels.get(key) == value for key, value in wanted.items())


def _namespace_labels(name: str) -> dict[str, str]:
    # The API server labels every namespace with its name (Kubernetes 1.22+).
    return {"kubernetes.io/metadata.name": name, "team": "x"}


def admits(
    policy: Obj,
    target: Obj,
    peer_namespace: str,
    peer_labels: Mapping[str, str],
    port_name: str,
) -> bool:
    """Whether `policy` (in INSTALL_NAMESPACE) lets a pod with `peer_labels` in
    `peer_namespace` reach the named container port of the workload `target`."""
    spec = policy["spec"]
    if not _matches(spec["podSelector"], _pod_labels(target)):
        return True  # not a pod this policy isolates
    assert "Ingress" in spec["policyTypes"]
    numbers = {p["name"]: p["containerPort"] for p in _jobsignal_container(target)["ports"]}
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        port_ok = not ports or any(
            p.get("protocol", "TCP") == "TCP"
            and (p["port"] == port_name or p["port"] == numbers[port_name])
            for p in ports
        )
        peers = rule.get("from")
        peer_ok = not peers or any(
            _peer_matches(peer, peer_namespace, peer_labels) for peer in peers
        )
        if port_ok and peer_ok:
            return True
    return False


def _peer_matches(peer: Obj, namespace: str, labels: Mapping[str, str]) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not evaluated here"
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], _namespace_labels(namespace))
    else:
        in_namespace = namespace == INSTALL_NAMESPACE  # the policy's own namespace
    in_pods = _matches(peer.get("podSelector", {}), labels)
    return in_namespace and in_pods


# (who, their namespace, their pod's labels) -> (may reach grpc, may reach metrics)
PEERS: list[tuple[str, str, dict[str, str], tuple[bool, bool]]] = [
    ("a labelled client elsewhere", "training", {**CLIENT_LABEL, "app": "ccae"}, (True, False)),
    ("a labelled client beside it", INSTALL_NAMESPACE, CLIENT_LABEL, (True, False)),
    ("an unlabelled pod elsewhere", "training", {"app": "ccae"}, (False, False)),
    ("an unlabelled pod beside it", INSTALL_NAMESPACE, {"app": "other"}, (False, False)),
    ("Prometheus", MONITORING, {"app.kubernetes.io/name": "prometheus"}, (False, True)),
    ("a labelled pod in monitoring", MONITORING, CLIENT_LABEL, (True, True)),
    (
        "a pod that labels itself as the monitoring namespace",
        "training",
        {"kubernetes.io/metadata.name": MONITORING},
        (False, False),
    ),
    ("a client labelled false", "training", {"jobsignal-client": "false"}, (False, False)),
]


def _policy_and_target(objects: Sequence[Obj]) -> tuple[Obj, Obj]:
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (target,) = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    return policy, target


def _check_policy(objects: Sequence[Obj], where: str) -> None:
    policy, target = _policy_and_target(objects)
    spec = policy["spec"]
    # Ingress only: jobsignal must still reach the API server, wherever it is.
    assert spec["policyTypes"] == ["Ingress"], f"{where}: {spec['policyTypes']}"
    assert _matches(spec["podSelector"], _pod_labels(target)), f"{where}: selects no pod"
    names = {p["name"] for p in _jobsignal_container(target)["ports"]}
    for rule in spec["ingress"]:
        # An empty `from` or `ports` would admit everyone or every port.
        assert rule.get("from") and rule.get("ports"), f"{where}: a rule without from or ports"
        assert {p["port"] for p in rule["ports"]} <= names, f"{where}: {rule['ports']}"
    for who, namespace, labels, (grpc, metrics) in PEERS:
        reached = (
            admits(policy, target, namespace, labels, "grpc"),
            admits(policy, target, namespace, labels, "metrics"),
        )
        assert reached == (grpc, metrics), f"{where}: {who} reaches (grpc, metrics) {reached}"


@pytest.mark.parametrize(
    "install",
    [name for name in INSTALLS if _rel(COMPONENT) in name.split("+")],
)
def test_the_policy_admits_clients_to_grpc_and_monitoring_to_metrics(install: str) -> None:
    _check_policy(INSTALLS[install], install)


def test_the_policy_check_catches_an_open_door() -> None:
    """Not vacuous: a rule without `from` or `ports`, selectors that admit either
    instead of both, and metrics open to every namespace are all found."""
    name = next(name for name in INSTALLS if _rel(COMPONENT) in name.split("+"))
    for breaking in ("from", "ports"):
        objects = copy.deepcopy(INSTALLS[name])
        policy, _ = _policy_and_target(objects)
        del policy["spec"]["ingress"][0][breaking]
        with pytest.raises(AssertionError):
            _check_policy(objects, f"without {breaking}")
    # The classic slip: namespace and pod selector as two peers (either admits)
    # instead of one (both must match) lets every pod of the cluster in.
    objects = copy.deepcopy(INSTALLS[name])
    policy, _ = _policy_and_target(objects)
    policy["spec"]["ingress"][0]["from"] = [
        {"namespaceSelector": {}},
        {"podSelector": {"matchLabels": CLIENT_LABEL}},
    ]
    with pytest.raises(AssertionError, match="an unlabelled pod elsewhere reaches"):
        _check_policy(objects, "two peers")
    objects = copy.deepcopy(INSTALLS[name])
    policy, _ = _policy_and_target(objects)
    policy["spec"]["ingress"][1]["from"] = [{"namespaceSelector": {}}]
    with pytest.raises(AssertionError, match=r"elsewhere reaches \(grpc, metrics\) \(\w+, True\)"):
        _check_policy(objects, "metrics from every namespace")


@needs_kubectl
@pytest.mark.parametrize("directory", ROOT_KUSTOMIZATIONS, ids=_rel)
def test_the_rendered_policy_admits_the_same(directory: Path, tmp_path: Path) -> None:
    """Rendered into each install (in its namespace, alone and with the other
    components), the policy still selects the install's pods and admits the same."""
    assert COMPONENT in COMPONENTS
    for components in ((COMPONENT,), tuple(COMPONENTS)):
        out = tmp_path / "-".join(c.name for c in components)
        out.mkdir()
        objects = _render_with(directory, components, out)
        where = _install_name(directory, components)
        policy, _ = _policy_and_target(objects)
        assert policy["metadata"]["namespace"] == INSTALL_NAMESPACE, where
        _check_policy(objects, where)
