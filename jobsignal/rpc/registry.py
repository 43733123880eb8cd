"""Client registrations: who may subscribe, under which role, and how many.

Pure bookkeeping with time passed in (trio's clock in production). ClusterD's
contract: Register hands out a fresh id per call; an id is good for one
subscription at a time and is freed when that subscription's stream ends. On
top of that, ids never used expire after `ttl` so that clients that register
and vanish cannot fill the registry.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from grpclib.const import Status


class Refused(Exception):
    """A request the registry turns down; carries the gRPC status to answer with."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RegistryFull(Exception):
    """Too many registered ids: Register answers Status{429} (not a gRPC error)."""


@dataclass(eq=False)
class Claim:
    """One active subscription of a registered id."""

    client_id: str
    role: str


@dataclass(eq=False)
class _Registration:
    role: str
    registered_at: float
    claim: Claim | None = None


class Registry:
    def __init__(
        self,
        *,
        roles: Collection[str],
        max_registrations: int,
        max_subscriptions_per_role: int,
        ttl: float,
    ) -> None:
        self.roles = tuple(roles)
        self.max_registrations = max_registrations
        self.max_subscriptions_per_role = max_subscriptions_per_role
        self.ttl = ttl
        # Insertion order = registration order, so expiry pops from the front.
        self._unclaimed: OrderedDict[str, _Registration] = OrderedDict()
        self._claimed: dict[str, _Registration] = {}
        self._active_per_role: Counter[str] = Counter()
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._unclaimed) + len(self._claimed)

    def active_subscriptions(self, role: str | None = None) -> int:
        if role is None:
            return sum(self._active_per_role.values())
        return self._active_per_role[role]

    def register(self, role: str, now: float) -> str:
        """A new client id for `role`; Refused for an unknown role, RegistryFull when full."""
        if role not in self.roles:
            allowed = ", ".join(self.roles)
            raise Refused(
                Status.INVALID_ARGUMENT,
                f"role {role!r} is not allowed; register with one of: {allowed}",
            )
        self.expire(now)
        if len(self) >= self.max_registrations:
            raise RegistryFull
        client_id = str(uuid.uuid4())
        self._unclaimed[client_id] = _Registration(role, now)
        return client_id

    def expire(self, now: float) -> None:
        """Drop ids registered more than `ttl` ago that never subscribed."""
        while self._unclaimed:
            client_id, registration = next(iter(self._unclaimed.items()))
            if now - registration.registered_at < self.ttl:
                return
            del self._unclaimed[client_id]
            self.expired_total += 1

    def claim(self, client_id: str, role: str, now: float) -> tuple[Claim, Claim | None]:
        """Start a subscription for `client_id`.

        Returns the new claim and the claim it replaces (a second subscription
        with the same id replaces the first), or raises Refused.
        """
        self.expire(now)
        registration = self._unclaimed.get(client_id) or self._claimed.get(client_id)
        if registration is None:
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"clientId {client_id!r} is not registered (unknown, expired, or its"
                " subscription already ended): call Register and subscribe with the"
                " clientId it returns",
            )
        if registration.role != role:
            raise Refused(
                Status.PERMISSION_DENIED,
                f"clientId {client_id!r} was registered with role {registration.role!r},"
                f" not {role!r}: subscribe with the role you registered with",
            )
        replaced = registration.claim
        if replaced is None:
            if self._active_per_role[role] >= self.max_subscriptions_per_role:
                raise Refused(
                    Status.RESOURCE_EXHAUSTED,
                    f"role {role!r} already has {self.max_subscriptions_per_role} active"
                    " subscriptions (the limit): end one before subscribing again",
                )
            self._active_per_role[role] += 1
            del self._unclaimed[client_id]
            self._claimed[client_id] = registration
        claim = Claim(client_id, role)
        registration.claim = claim
        return claim, replaced

    def release(self, claim: Claim) -> None:
        """The subscription ended: free its id, unless a newer claim took it over."""
        registration = self._claimed.get(claim.client_id)
        if registration is None or registration.claim is not claim:
            return
        del self._claimed[claim.client_id]
        self._active_per_role[claim.role] -= 1
