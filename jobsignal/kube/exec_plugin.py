"""A kubeconfig user's ``exec`` stanza as jobsignal keeps it, and the errors of its plugin.

kube.credentials checks the stanza and makes an :class:`ExecPlugin`;
kube.exec_credentials runs it. Apart, so that reading a kubeconfig without
an ``exec`` user, and translating a plugin's errors at the API boundary
(kube.api), load nothing of the runner (docs/architecture.md section 10,
"Memory at idle").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The ExecCredential versions client-go still speaks (v1alpha1 was removed in 1.24).
API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


class ExecCredentialError(Exception):
    """The plugin could not provide a credential; the message is one line, without secrets."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's ``exec`` stanza, checked and resolved."""

    #: The program, made absolute when the kubeconfig gives a relative path.
    command: str
    args: tuple[str, ...]
    #: The entry's ``env`` list; values may be secrets, so they stay out of repr.
    env: tuple[tuple[str, str], ...] = field(repr=False)
    api_version: str
    #: The JSON for ``KUBERNETES_EXEC_INFO`` (see :func:`exec_info`).
    exec_info: str = field(repr=False)
    #: ``exec plugin 'aws' of user 'u' in kubeconfig /path``: where errors point.
    label: str
    install_hint: str | None = None


def exec_info(api_version: str, cluster: Mapping[str, Any] | None) -> str:
    """The ``KUBERNETES_EXEC_INFO`` value: an ExecCredential request.

    ``spec.interactive`` is always false (jobsignal has no terminal);
    ``spec.cluster`` is present only when the kubeconfig sets
    ``provideClusterInfo: true``. *cluster* holds the fields of the
    client.authentication.k8s.io ``Cluster`` type (``server``,
    ``certificate-authority-data`` as base64, ``config``, ...).
    """
    spec: dict[str, Any] = {"interactive": False}
    if cluster is not None:
        spec["cluster"] = dict(cluster)
    document = {"apiVersion": api_version, "kind": "ExecCredential", "spec": spec}
    # default=str: YAML may hand dates inside the config extension.
    return json.dumps(document, separators=(",", ":"), default=str)
