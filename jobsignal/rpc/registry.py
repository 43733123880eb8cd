"""Client registrations: who may subscribe, under which role, and how many.

Pure bookkeeping with time passed in (trio's clock in production). ClusterD's
contract: Register hands out a fresh id per call; an id is good for one
subscription at a time and is freed when that subscription's stream ends. On
top of that, ids never used expire after `ttl` so that clients that register
and vanish cannot fill the registry.

No single client address may take a whole pool: it holds at most
`max_registrations_per_ip` ids that are registered but not yet subscribed,
and at most `max_subscriptions_per_role_per_ip` of each role's subscription
slots. Addresses are passed in by the caller (the connection's peer address).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from grpclib.const import Status

from jobsignal.config import Config
from jobsignal.util.uuids import random_uuid


class Refused(Exception):
    """A request the registry turns down; carries the gRPC status to answer with."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RegistryFull(Exception):
    """No room for another id, in total or for this address.

    Register answers with a normal Status{429, str(error)}, not a gRPC error,
    as ClusterD does when it is full.
    """


@dataclass(eq=False)
class Claim:
    """One active subscription of a registered id."""

    client_id: str
    role: str
    address: str  # the subscriber's, which holds the role's slot


@dataclass(eq=False)
class _Registration:
    role: str
    registered_at: float
    address: str  # the registering client's
    claim: Claim | None = None


def _decrement(counter: Counter[Any], key: Any) -> None:
    """Count one less, forgetting keys at zero so tables stay as small as the live set."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


class Registry:
    def __init__(
        self,
        *,
        roles: Collection[str],
        max_registrations: int,
        max_subscriptions_per_role: int,
        ttl: float,
        max_registrations_per_ip: int | None = None,
        max_subscriptions_per_role_per_ip: int | None = None,
    ) -> None:
        """Per-address shares left out (None) are the whole pool: no share at all."""
        self.roles = tuple(roles)
        self.max_registrations = max_registrations
        self.max_subscriptions_per_role = max_subscriptions_per_role
        self.ttl = ttl
        self.max_registrations_per_ip = (
            max_registrations if max_registrations_per_ip is None else max_registrations_per_ip
        )
        self.max_subscriptions_per_role_per_ip = (
            max_subscriptions_per_role
            if max_subscriptions_per_role_per_ip is None
            else max_subscriptions_per_role_per_ip
        )
        # Insertion order = registration order, so expiry pops from the front.
        self._unclaimed: OrderedDict[str, _Registration] = OrderedDict()
        self._claimed: dict[str, _Registration] = {}
        self._active_per_role: Counter[str] = Counter()
        self._unclaimed_per_address: Counter[str] = Counter()
        self._active_per_role_and_address: Counter[tuple[str, str]] = Counter()
        self.expired_total = 0

    @classmethod
    def from_config(cls, config: Config) -> Registry:
        return cls(
            roles=config.roles,
            max_registrations=config.max_registrations,
            max_subscriptions_per_role=config.max_subscriptions_per_role,
            ttl=config.registration_ttl,
            max_registrations_per_ip=config.max_registrations_per_ip,
            max_subscriptions_per_role_per_ip=config.max_subscriptions_per_role_per_ip,
        )

    def __len__(self) -> int:
        return len(self._unclaimed) + len(self._claimed)

    def active_subscriptions(self, role: str | None = None) -> int:
        if role is None:
            return sum(self._active_per_role.values())
        return self._active_per_role[role]

    def pending_of(self, address: str) -> int:
        """Ids `address` registered that have not subscribed (nor expired) yet."""
        return self._unclaimed_per_address[address]

    def held_by(self, address: str, role: str) -> int:
        """Subscription slots of `role` that `address` holds."""
        return self._active_per_role_and_address[role, address]

    def register(self, role: str, now: float, *, address: str) -> str:
        """A new client id for `role`, registered by `address`.

        Refused for an unknown role; RegistryFull when the registry is full or
        `address` already has its share of ids waiting for their subscription.
        """
        if role not in self.roles:
            allowed = ", ".join(self.roles)
            raise Refused(
                Status.INVALID_ARGUMENT,
                f"role {role!r} is not allowed; register with one of: {allowed}",
            )
        self.expire(now)
        if self._unclaimed_per_address[address] >= self.max_registrations_per_ip:
            raise RegistryFull(
                f"too many pending registrations from your address {address}"
                f" (limit {self.max_registrations_per_ip} per address): subscribe with the"
                f" ids you registered, or retry once unused ones expire ({self.ttl:g}s)"
            )
        if len(self) >= self.max_registrations:
            raise RegistryFull(
                f"too many registered clients (limit {self.max_registrations}); retry later"
            )
        client_id = random_uuid()
        self._unclaimed[client_id] = _Registration(role, now, address)
        self._unclaimed_per_address[address] += 1
        return client_id

    def expire(self, now: float) -> None:
        """Drop ids registered more than `ttl` ago that never subscribed."""
        while self._unclaimed:
            client_id, registration = next(iter(self._unclaimed.items()))
            if now - registration.registered_at < self.ttl:
                return
            del self._unclaimed[client_id]
            _decrement(self._unclaimed_per_address, registration.address)
            self.expired_total += 1

    def claim(
        self, client_id: str, role: str, now: float, *, address: str
    ) -> tuple[Claim, Claim | None]:
        """Start a subscription for `client_id`, from the client at `address`.

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
        # A replacement from the same address keeps its slot; one from another
        # address takes the slot over, so it must fit in that address's share.
        if replaced is None or replaced.address != address:
            self._check_share(role, address)
        if replaced is None:
            if self._active_per_role[role] >= self.max_subscriptions_per_role:
                raise Refused(
                    Status.RESOURCE_EXHAUSTED,
                    f"role {role!r} already has {self.max_subscriptions_per_role} active"
                    " subscriptions (the limit): end one before subscribing again",
                )
            self._active_per_role[role] += 1
            del self._unclaimed[client_id]
            _decrement(self._unclaimed_per_address, registration.address)
            self._claimed[client_id] = registration
        else:
            _decrement(self._active_per_role_and_address, (role, replaced.address))
        self._active_per_role_and_address[role, address] += 1
        claim = Claim(client_id, role, address)
        registration.claim = claim
        return claim, replaced

    def _check_share(self, role: str, address: str) -> None:
        held = self._active_per_role_and_address[role, address]
        if held >= self.max_subscriptions_per_role_per_ip:
            raise Refused(
                Status.RESOURCE_EXHAUSTED,
                f"address {address} already holds {held} of role {role!r}'s subscriptions"
                f" (limit {self.max_subscriptions_per_role_per_ip} per address): end one"
                " before subscribing again",
            )

    def release(self, claim: Claim) -> None:
        """The subscription ended: free its id, unless a newer claim took it over."""
        registration = self._claimed.get(claim.client_id)
        if registration is None or registration.claim is not claim:
            return
        del self._claimed[claim.client_id]
        self._active_per_role[claim.role] -= 1
        _decrement(self._active_per_role_and_address, (claim.role, claim.address))
