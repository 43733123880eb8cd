"""Per-address quotas: one client address can take neither the whole registry nor a role's slots.

Most tests drive the pure Registry with time passed in (virtual time by
construction); two run the real server against grpcio over 127.0.0.1, with
a raw HTTP/2 Register from 127.0.0.2 to show that another address is not
held to 127.0.0.1's share.
"""

from __future__ import annotations

import contextlib
import random

import grpc
import pytest
import trio
from grpclib.const import Status

from jobsignal.config import configure, defaults
from jobsignal.rpc.registry import Claim, Refused, Registry, RegistryFull
from tests.support.grpc_server import ROLES, make_registry, open_jobsignal_server
from tests.support.grpcio import GrpcioClients, GrpcioStream, GrpcioStubs, rpc_error
from tests.support.h2_client import LOOPBACK, OTHER_LOOPBACK, raw_register
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
ROLE, OTHER_ROLE = "CCAgent", "FdAgent"
TTL = 300.0


def small_registry(*, pool: int, per_ip: int, slots: int = 4, slots_per_ip: int = 2) -> Registry:
    """`pool` ids, `per_ip` pending per address; `slots` per role, `slots_per_ip` per address."""
    return make_registry(
        max_registrations=pool,
        max_registrations_per_ip=per_ip,
        max_subscriptions_per_role=slots,
        max_subscriptions_per_role_per_ip=slots_per_ip,
        ttl=TTL,
    )


def pending_message(address: str, limit: int) -> str:
    return (
        f"too many pending registrations from your address {address} (limit {limit} per"
        f" address): subscribe with the ids you registered, or retry once unused ones expire"
        f" ({TTL:g}s)"
    )


def share_message(address: str, held: int, role: str, limit: int) -> str:
    return (
        f"address {address} already holds {held} of role {role!r}'s subscriptions"
        f" (limit {limit} per address): end one before subscribing again"
    )


def register_until_full(registry: Registry, address: str, now: float = 0.0) -> list[str]:
    ids = []
    with pytest.raises(RegistryFull):
        while True:
            ids.append(registry.register(ROLE, now, address=address))
            assert len(ids) <= registry.max_registrations
    return ids


def claim_until_refused(registry: Registry, address: str, role: str = ROLE) -> list[Claim]:
    claims: list[Claim] = []
    while True:
        client_id = registry.register(role, 0.0, address=address)
        try:
            claim, _ = registry.claim(client_id, role, 0.0, address=address)
        except Refused as refusal:
            assert refusal.status is Status.RESOURCE_EXHAUSTED
            return claims
        claims.append(claim)


# -- registrations ------------------------------------------------------------------------


def test_one_address_holds_at_most_its_share_of_pending_ids() -> None:
    registry = small_registry(pool=8, per_ip=3)
    assert len(register_until_full(registry, A)) == 3
    with pytest.raises(RegistryFull) as full:
        registry.register(OTHER_ROLE, 1.0, address=A)
    assert str(full.value) == pending_message(A, 3)
    assert registry.pending_of(A) == 3
    # Others are not held to A's count; the pool is still the pool.
    assert len(register_until_full(registry, B)) == 3
    assert len(register_until_full(registry, C)) == 2
    with pytest.raises(RegistryFull) as pool_full:
        registry.register(ROLE, 1.0, address="10.0.0.4")
    assert str(pool_full.value) == "too many registered clients (limit 8); retry later"
    assert len(registry) == 8


def test_subscribing_or_expiring_frees_the_pending_share() -> None:
    registry = small_registry(pool=100, per_ip=2)
    first, _second = register_until_full(registry, A, now=10.0)
    registry.claim(first, ROLE, 11.0, address=A)
    assert registry.pending_of(A) == 1
    registry.register(ROLE, 12.0, address=A)
    with pytest.raises(RegistryFull):
        registry.register(ROLE, 12.0, address=A)
    # `second` expires at 10 + TTL, `third` only at 12 + TTL.
    registry.expire(10.0 + TTL)
    assert registry.pending_of(A) == 1
    registry.register(ROLE, 10.0 + TTL, address=A)
    registry.expire(12.0 + 2 * TTL)
    assert registry.pending_of(A) == 0
    assert registry.expired_total == 3
    # Nothing is kept for an address with nothing pending.
    assert not registry._unclaimed_per_address


def test_a_subscription_frees_the_registrants_pending_share_not_the_subscribers() -> None:
    registry = small_registry(pool=100, per_ip=2, slots=10, slots_per_ip=5)
    client_id = registry.register(ROLE, 0.0, address=A)
    registry.register(ROLE, 0.0, address=B)
    registry.claim(client_id, ROLE, 0.0, address=B)
    assert (registry.pending_of(A), registry.pending_of(B)) == (0, 1)
    assert (registry.held_by(A, ROLE), registry.held_by(B, ROLE)) == (0, 1)


# -- subscription slots ----------------------------------------------------------------------


def test_one_address_holds_at_most_its_share_of_a_roles_slots() -> None:
    registry = small_registry(pool=100, per_ip=100, slots=4, slots_per_ip=2)
    a_claims = claim_until_refused(registry, A)
    assert len(a_claims) == 2
    refused_id = registry.register(ROLE, 0.0, address=A)
    with pytest.raises(Refused) as refusal:
        registry.claim(refused_id, ROLE, 0.0, address=A)
    assert refusal.value.status is Status.RESOURCE_EXHAUSTED
    assert refusal.value.message == share_message(A, 2, ROLE, 2)
    # The share is per role, and per address.
    assert len(claim_until_refused(registry, A, OTHER_ROLE)) == 2
    assert len(claim_until_refused(registry, B)) == 2
    assert registry.active_subscriptions(ROLE) == 4
    # The role is full now: a third address gets the role's own message.
    c_id = registry.register(ROLE, 0.0, address=C)
    with pytest.raises(Refused) as role_full:
        registry.claim(c_id, ROLE, 0.0, address=C)
    assert "already has 4 active subscriptions (the limit)" in role_full.value.message
    # A subscription ending frees its address's slot; the refused id was not burnt.
    registry.release(a_claims[0])
    assert registry.held_by(A, ROLE) == 1
    registry.claim(refused_id, ROLE, 0.0, address=A)
    assert registry.held_by(A, ROLE) == 2


def test_replacing_from_the_same_address_keeps_the_slot() -> None:
    registry = small_registry(pool=100, per_ip=100, slots=4, slots_per_ip=1)
    client_id = registry.register(ROLE, 0.0, address=A)
    first, _ = registry.claim(client_id, ROLE, 0.0, address=A)
    second, replaced = registry.claim(client_id, ROLE, 1.0, address=A)
    assert replaced is first
    assert registry.held_by(A, ROLE) == 1
    registry.release(first)  # the replaced stream ends later: nothing changes
    assert registry.held_by(A, ROLE) == 1
    registry.release(second)
    assert registry.held_by(A, ROLE) == 0
    assert not registry._active_per_role_and_address


def test_replacing_from_another_address_moves_the_slot_within_its_share() -> None:
    registry = small_registry(pool=100, per_ip=100, slots=4, slots_per_ip=1)
    moving = registry.register(ROLE, 0.0, address=A)
    first, _ = registry.claim(moving, ROLE, 0.0, address=A)
    b_id = registry.register(ROLE, 0.0, address=B)
    b_claim, _ = registry.claim(b_id, ROLE, 0.0, address=B)
    # B holds its one slot already: it may not take A's over.
    with pytest.raises(Refused) as refusal:
        registry.claim(moving, ROLE, 1.0, address=B)
    assert refusal.value.message == share_message(B, 1, ROLE, 1)
    assert (registry.held_by(A, ROLE), registry.held_by(B, ROLE)) == (1, 1)
    # C has room: the slot moves from A to C.
    moved, replaced = registry.claim(moving, ROLE, 2.0, address=C)
    assert replaced is first
    assert (registry.held_by(A, ROLE), registry.held_by(C, ROLE)) == (0, 1)
    assert registry.active_subscriptions(ROLE) == 2
    registry.release(first)
    registry.release(moved)
    registry.release(b_claim)
    assert registry.active_subscriptions(ROLE) == 0
    assert not registry._active_per_role_and_address


def test_without_shares_the_pool_is_the_only_limit() -> None:
    registry = Registry(roles=ROLES, max_registrations=6, max_subscriptions_per_role=3, ttl=TTL)
    assert len(register_until_full(registry, A)) == 6
    registry = Registry(roles=ROLES, max_registrations=60, max_subscriptions_per_role=3, ttl=TTL)
    assert len(claim_until_refused(registry, A)) == 3


def test_defaults_leave_most_of_every_pool_to_other_addresses() -> None:
    config = defaults()
    assert (config.max_registrations, config.max_registrations_per_ip) == (1024, 128)
    assert (config.max_subscriptions_per_role, config.max_subscriptions_per_role_per_ip) == (20, 10)
    registry = Registry.from_config(config)
    assert len(register_until_full(registry, A)) == 128
    registry = Registry.from_config(config)
    assert len(claim_until_refused(registry, A)) == 10
    assert len(claim_until_refused(registry, B)) == 10
    assert registry.active_subscriptions(ROLE) == 20


def test_bookkeeping_matches_a_recount_after_random_operations() -> None:
    rng = random.Random(8)
    registry = small_registry(pool=12, per_ip=4, slots=5, slots_per_ip=3)
    addresses, roles = [A, B, C], [ROLE, OTHER_ROLE]
    ids: list[str] = []
    claims: list[Claim] = []
    now = 0.0
    for _ in range(3000):
        now += rng.choice([0.0, 1.0, 30.0])
        action = rng.random()
        address = rng.choice(addresses)
        if action < 0.4:
            with contextlib.suppress(RegistryFull):
                ids.append(registry.register(rng.choice(roles), now, address=address))
        elif action < 0.8 and ids:
            with contextlib.suppress(Refused):
                claim, _ = registry.claim(rng.choice(ids), rng.choice(roles), now, address=address)
                claims.append(claim)
        elif claims:
            registry.release(claims.pop(rng.randrange(len(claims))))
        registry.expire(now)
        unclaimed = registry._unclaimed.values()
        live = [r.claim for r in registry._claimed.values() if r.claim is not None]
        for address in addresses:
            pending = sum(r.address == address for r in unclaimed)
            assert registry.pending_of(address) == pending <= 4
            for role in roles:
                held = sum(c.address == address and c.role == role for c in live)
                assert registry.held_by(address, role) == held <= 3
        for role in roles:
            assert registry.active_subscriptions(role) == sum(c.role == role for c in live) <= 5
        assert len(registry) <= 12


# -- over gRPC ---------------------------------------------------------------------------------


async def test_register_past_the_address_share_answers_429(
    grpc_clients: GrpcioClients, grpcio_stubs: GrpcioStubs
) -> None:
    share = 3
    config = configure(max_registrations=100, max_registrations_per_ip=share)
    assert config.registration_ttl == TTL  # named in the refusal
    registry = Registry.from_config(config)
    async with trio.open_nursery() as nursery, open_jobsignal_server(registry=registry) as server:
        client = grpc_clients.connect(server.target)
        ids = [await in_thread(client.register_id, ROLE) for _ in range(share)]
        for _ in range(2):
            # ClusterD's contract for a full registry holds for a full share too.
            refused = await in_thread(client.register, ROLE)
            assert (refused.code, refused.clientId) == (429, "")
            assert refused.info == pending_message(LOOPBACK, share)
        # Another address registers as usual.
        other = await raw_register(server.port, source=OTHER_LOOPBACK)
        assert other.grpc_status == 0, other
        assert grpcio_stubs.job_pb2.Status.FromString(other.message).code == 200
        assert server.registry.pending_of(OTHER_LOOPBACK) == 1
        # Subscribing with a pending id gives 127.0.0.1 room for one more.
        stream = GrpcioStream(client.subscribe(ROLE, ids[0], timeout=30)).start(nursery)
        await wait_until(lambda: server.registry.pending_of(LOOPBACK) == share - 1)
        assert (await in_thread(client.register, ROLE)).code == 200
        stream.call.cancel()
        await stream.wait_end()


async def test_subscribe_past_the_address_share_is_resource_exhausted(
    grpc_clients: GrpcioClients,
) -> None:
    share = 2
    registry = Registry.from_config(
        configure(max_subscriptions_per_role=5, max_subscriptions_per_role_per_ip=share)
    )
    async with trio.open_nursery() as nursery, open_jobsignal_server(registry=registry) as server:
        client = grpc_clients.connect(server.target)
        ids = [await in_thread(client.register_id, ROLE) for _ in range(share + 1)]
        streams = [
            GrpcioStream(client.subscribe(ROLE, client_id, timeout=30)).start(nursery)
            for client_id in ids[:share]
        ]
        await wait_until(lambda: server.registry.held_by(LOOPBACK, ROLE) == share)
        error = await rpc_error(lambda: list(client.subscribe(ROLE, ids[share], timeout=10)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == share_message(LOOPBACK, share, ROLE, share)
        # Another role's slots are a share of their own.
        other_id = await in_thread(client.register_id, OTHER_ROLE)
        other = GrpcioStream(client.subscribe(OTHER_ROLE, other_id, timeout=30)).start(nursery)
        await wait_until(lambda: server.registry.held_by(LOOPBACK, OTHER_ROLE) == 1)
        # Ending one stream frees the address's slot for the refused id.
        streams[0].call.cancel()
        assert (await streams[0].wait_end())[0] == grpc.StatusCode.CANCELLED
        await wait_until(lambda: server.registry.held_by(LOOPBACK, ROLE) == share - 1)
        streams.append(GrpcioStream(client.subscribe(ROLE, ids[share], timeout=30)).start(nursery))
        await wait_until(lambda: server.registry.held_by(LOOPBACK, ROLE) == share)
        assert len(server.broadcaster.subscribers) == share + 1
        for stream in [*streams[1:], other]:
            stream.call.cancel()
            await stream.wait_end()
        await wait_until(lambda: server.registry.active_subscriptions() == 0)
        assert not server.registry._active_per_role_and_address
