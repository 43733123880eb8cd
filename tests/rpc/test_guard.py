"""The HTTP/2 budgets of a connection and of its address (rpc/guard.py), frame by
frame, with time passed in."""

from __future__ import annotations

import itertools

import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given
from hypothesis import strategies as st

from jobsignal.rpc.guard import (
    CONTROL_FLOOD,
    FREE_CONTROL_FRAMES,
    PREFACE,
    PREMATURE_RESET_SECONDS,
    RAPID_RESET,
    AddressBudgets,
    AddressPacer,
    ConnectionBudget,
    ProtocolLimits,
    YoungStreams,
)

LIMITS = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second=5)


def wire(*frames: Frame) -> bytes:
    return b"".join(frame.serialize() for frame in frames)


def budget() -> ConnectionBudget:
    fresh = ConnectionBudget(LIMITS, now=0.0)
    assert fresh.charge_input(PREFACE + wire(SettingsFrame(0)), 0.0) is None
    return fresh


def test_control_frames_get_a_burst_of_twice_the_rate_then_the_rate() -> None:
    guard = budget()  # the client's SETTINGS took one token of 10
    assert guard.charge_input(wire(*[PingFrame(0)] * 9), 0.0) is None
    assert guard.charge_input(wire(PingFrame(0)), 0.0) == CONTROL_FLOOD
    # Half a second later 2.5 tokens have come back: two frames, not three.
    assert guard.charge_input(wire(PingFrame(0), PingFrame(0)), 0.5) is None
    assert guard.charge_input(wire(PingFrame(0)), 0.5) == CONTROL_FLOOD


def test_every_frame_but_request_headers_costs_a_token() -> None:
    guard = budget()
    headers = wire(HeadersFrame(1, b"", flags=["END_HEADERS"]))
    for _ in range(100):
        assert guard.charge_input(headers, 0.0) is None
    frames = wire(
        SettingsFrame(0),
        WindowUpdateFrame(0, window_increment=1),
        DataFrame(1, b"a request"),
        DataFrame(1, b"", flags=["END_STREAM"]),
    )
    # 9 tokens were left: two rounds of 4 pass, the third does not.
    assert guard.charge_input(frames, 0.0) is None
    assert guard.charge_input(frames, 0.0) is None
    assert guard.charge_input(frames, 0.0) == CONTROL_FLOOD


def test_frames_split_across_reads_are_counted_once() -> None:
    guard = budget()
    data = wire(*[PingFrame(0)] * 9)
    for start in range(0, len(data), 7):  # headers and payloads cut anywhere
        assert guard.charge_input(data[start : start + 7], 0.0) is None
    assert guard.charge_input(wire(PingFrame(0)), 0.0) == CONTROL_FLOOD


def test_frames_the_server_sends_earn_the_peer_window_updates() -> None:
    guard = budget()
    assert guard.charge_input(wire(*[PingFrame(0)] * 9), 0.0) is None
    guard.frames_sent(3)  # six more tokens
    assert guard.charge_input(wire(*[WindowUpdateFrame(1, window_increment=1)] * 6), 0.0) is None
    assert guard.charge_input(wire(PingFrame(0)), 0.0) == CONTROL_FLOOD


def test_stream_resets_have_their_own_budget() -> None:
    # Resets are control frames too: a large control budget leaves the reset rule alone.
    limits = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second=1000)
    guard = ConnectionBudget(limits, now=0.0)
    resets = [RstStreamFrame(1 + 2 * i) for i in range(20)]
    assert guard.charge_input(PREFACE + wire(*resets), 0.0) is None
    assert guard.charge_input(wire(RstStreamFrame(99)), 0.0) == RAPID_RESET
    assert guard.charge_input(wire(RstStreamFrame(101), RstStreamFrame(103)), 0.2) is None
    assert guard.charge_input(wire(RstStreamFrame(105)), 0.2) == RAPID_RESET


def resets(first: int, count: int) -> bytes:
    return wire(*[RstStreamFrame(first + 2 * i) for i in range(count)])


def test_connections_from_one_address_share_its_reset_budget() -> None:
    limits = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second=1000)
    budgets = AddressBudgets(limits)
    first = ConnectionBudget(limits, 0.0, budgets.of("127.0.0.2", 0.0))
    second = ConnectionBudget(limits, 0.0, budgets.of("127.0.0.2", 0.0))
    other = ConnectionBudget(limits, 0.0, budgets.of("127.0.0.3", 0.0))
    assert first.charge_input(PREFACE + resets(1, 12), 0.0) is None
    # The burst is 20 for the address, not for each of its connections.
    assert second.charge_input(PREFACE + resets(1, 8), 0.0) is None
    assert second.charge_input(resets(17, 1), 0.0) == RAPID_RESET
    assert first.charge_input(resets(25, 1), 0.0) == RAPID_RESET
    assert other.charge_input(PREFACE + resets(1, 20), 0.0) is None
    # Reconnecting does not refill it: a new connection of the address finds it empty...
    again = ConnectionBudget(limits, 0.5, budgets.of("127.0.0.2", 0.5))
    assert again.charge_input(PREFACE + resets(1, 5), 0.5) is None  # (half a second: 5 back)
    assert again.charge_input(resets(11, 1), 0.5) == RAPID_RESET


def opens(first: int, count: int) -> bytes:
    return wire(*[HeadersFrame(first + 2 * i, b"", flags=["END_HEADERS"]) for i in range(count)])


def test_cancelling_many_long_lived_streams_at_once_is_not_rapid_reset() -> None:
    """A client process exiting with 500 subscriptions open for seconds resets them
    all at once: none was opened in the last PREMATURE_RESET_SECONDS, so none counts."""
    limits = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second=1000)
    guard = ConnectionBudget(limits, now=0.0)
    assert guard.charge_input(PREFACE + opens(1, 500), 0.0) is None
    assert guard.charge_input(resets(1, 500), 2 * PREMATURE_RESET_SECONDS) is None
    assert guard.address.resets.full(2 * PREMATURE_RESET_SECONDS)


@pytest.mark.parametrize("age", [0.0, 0.5, 0.99])
def test_resetting_streams_within_a_second_of_opening_them_counts(age: float) -> None:
    limits = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second=1000)
    guard = ConnectionBudget(limits, now=0.0)
    assert guard.charge_input(PREFACE + opens(1, 21), 0.0) is None
    assert guard.charge_input(resets(1, 20), age) is None
    assert guard.charge_input(resets(41, 1), age) == RAPID_RESET


def test_young_streams_are_those_of_this_epoch_and_the_one_before() -> None:
    young = YoungStreams(now=0.0)
    young.opened(1, 0.2)
    young.opened(3, 1.5)
    assert young.young(1, 1.9) and young.young(3, 1.9)  # 1.7 s old: still counted
    assert not young.young(1, 2.0) and young.young(3, 2.0)
    assert young.young(99, 2.0)  # never opened: counted
    young.opened(5, 2.1)
    assert not young.young(3, 5.0) and not young.young(5, 5.0)
    assert young.young(7, 5.0)


def test_the_address_budgets_forget_idle_ones_of_addresses_not_connected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(AddressBudgets, "FORGET_ABOVE", 4)
    # 10 resets a second (bursts of 20), 10 metered control frames (bursts of 20).
    limits = ProtocolLimits(max_resets_per_second=10, max_control_frames_per_second_per_ip=10)
    budgets = AddressBudgets(limits)
    resets_spent = budgets.of("127.0.0.2", 0.0)
    assert resets_spent.resets.take(0.0, 20)
    paced = budgets.of("127.0.0.6", 0.0)
    assert paced.control.delay(20, 0.0) == 0.0  # its whole burst
    connected = budgets.of("127.0.0.3", 0.0)
    budgets.of("127.0.0.4", 0.0)
    assert len(budgets) == 4
    # One second later: .2 and .6 have half their bursts back and are kept, .3 is
    # idle but connected and kept, .4 is idle and forgotten to make room for .5.
    budgets.of("127.0.0.5", 1.0, connected={"127.0.0.3"})
    assert len(budgets) == 4
    assert budgets.of("127.0.0.2", 1.0) is resets_spent
    assert budgets.of("127.0.0.6", 1.0) is paced
    assert budgets.of("127.0.0.3", 1.0) is connected


def test_the_address_pacer_lets_a_burst_by_then_gives_each_frame_its_turn() -> None:
    pacer = AddressPacer(rate=10.0, burst=20.0, now=0.0)
    assert pacer.delay(20, 0.0) == 0.0
    # Over the burst, each frame's turn is reserved in order: 0.1 s apart.
    assert pacer.delay(1, 0.0) == pytest.approx(0.1)
    assert pacer.delay(5, 0.0) == pytest.approx(0.6)
    assert not pacer.idle(2.5)
    # Once its turns are paid for, the burst is available again.
    assert pacer.idle(2.6)
    assert pacer.delay(20, 2.6) == 0.0
    # Waiting is what pays: frames counted later wait less.
    assert pacer.delay(10, 3.1) == pytest.approx(0.5)


# An address's pacer lets 10 frames a second by (bursts of 20) beyond each
# connection's allowance (FREE_CONTROL_FRAMES at once, then one a second) and
# credit; a connection alone may send 100 (bursts of 200).
SHARED = ProtocolLimits(
    max_resets_per_second=10,
    max_control_frames_per_second=100,
    max_control_frames_per_second_per_ip=10,
)


def pings(count: int) -> bytes:
    return wire(*[PingFrame(0)] * count)


def connected(budgets: AddressBudgets, address: str, now: float) -> ConnectionBudget:
    """A new connection of `address` that has sent its preface and SETTINGS."""
    fresh = ConnectionBudget(SHARED, now, budgets.of(address, now))
    assert fresh.charge_input(PREFACE + wire(SettingsFrame(0)), now) is None
    assert fresh.address_delay(now) == 0.0
    return fresh


def charged(guard: ConnectionBudget, data: bytes, now: float) -> float:
    """Charge `data`, which breaks no rule; the seconds it must wait for the address."""
    assert guard.charge_input(data, now) is None
    return guard.address_delay(now)


def test_connections_from_one_address_share_its_pacer_and_wait_their_turn() -> None:
    budgets = AddressBudgets(SHARED)
    first = connected(budgets, "127.0.0.2", 0.0)
    second = connected(budgets, "127.0.0.2", 0.0)
    other = connected(budgets, "127.0.0.3", 0.0)
    # Each connection's first frames (its SETTINGS among them) are its own...
    handshake = FREE_CONTROL_FRAMES - 1
    assert charged(first, pings(handshake), 0.0) == 0.0
    assert charged(second, pings(handshake), 0.0) == 0.0
    # ...beyond them, both draw on the address's burst of 20, far under their own
    # 200; over it, their input waits its turn instead of being refused.
    assert charged(first, pings(12), 0.0) == 0.0
    assert charged(second, pings(8), 0.0) == 0.0
    assert charged(second, pings(5), 0.0) == pytest.approx(0.5)
    assert charged(first, pings(1), 0.0) == pytest.approx(0.6)
    # Another address has a pacer of its own.
    assert charged(other, pings(handshake + 20), 0.0) == 0.0


def test_many_connections_of_one_address_handshake_without_waiting() -> None:
    """Clients behind one NAT address that connect at once do not wait for each
    other's handshakes, however many they are; a connection that goes on does."""
    budgets = AddressBudgets(SHARED)
    crowd = [connected(budgets, "127.0.0.2", 0.0) for _ in range(100)]
    for client in crowd:  # SETTINGS ACK, WINDOW_UPDATE, a PING: 4 with the SETTINGS
        frames = wire(SettingsFrame(0, flags=["ACK"]), WindowUpdateFrame(0, window_increment=1))
        assert charged(client, frames + pings(1), 0.0) == 0.0
    assert budgets.of("127.0.0.2", 0.0).control.idle(0.0)
    assert charged(crowd[0], pings(FREE_CONTROL_FRAMES - 4 + 20), 0.0) == 0.0
    assert charged(crowd[1], pings(FREE_CONTROL_FRAMES - 4 + 1), 0.0) == pytest.approx(0.1)


def test_frames_paid_by_the_data_sent_never_wait_for_the_address() -> None:
    """A client answering the data it receives (WINDOW_UPDATEs, grpc-go's BDP
    pings) spends the credit that data earned it, not its address's turns."""
    budgets = AddressBudgets(SHARED)
    flooder = connected(budgets, "127.0.0.2", 0.0)
    neighbour = connected(budgets, "127.0.0.2", 0.0)
    assert charged(flooder, pings(FREE_CONTROL_FRAMES - 1 + 20), 0.0) == 0.0
    assert charged(flooder, pings(30), 0.0) == pytest.approx(3.0)  # the address is behind
    neighbour.frames_sent(50)  # 100 frames of credit
    updates = wire(*[WindowUpdateFrame(1, window_increment=1)] * 100)
    assert charged(neighbour, pings(FREE_CONTROL_FRAMES - 1) + updates, 0.0) == 0.0
    # Its credit spent, the neighbour's next frame takes a turn like any other.
    assert charged(neighbour, pings(1), 0.0) == pytest.approx(3.1)


def test_a_connections_occasional_frame_never_waits_for_the_address() -> None:
    """Beyond its handshake, each connection may send one frame a second of its
    own (an idle client's keepalive PING) while its address's pacer is behind."""
    budgets = AddressBudgets(SHARED)
    flooder = connected(budgets, "127.0.0.2", 0.0)
    idle = connected(budgets, "127.0.0.2", 0.0)
    assert charged(idle, pings(FREE_CONTROL_FRAMES - 1), 0.0) == 0.0
    assert charged(flooder, pings(FREE_CONTROL_FRAMES - 1 + 20 + 50), 0.0) == pytest.approx(5.0)
    assert charged(idle, pings(1), 1.0) == 0.0
    assert charged(idle, pings(1), 1.0) == pytest.approx(4.1)  # its second in that second


def test_a_connection_over_its_own_budget_is_still_cut_off() -> None:
    """The address's pacer slows; a single connection over its own budget is a
    flood all the same, and gets GOAWAY as before."""
    limits = ProtocolLimits(max_control_frames_per_second=5, max_control_frames_per_second_per_ip=1)
    guard = ConnectionBudget(limits, 0.0, AddressBudgets(limits).of("127.0.0.2", 0.0))
    assert guard.charge_input(PREFACE + pings(10), 0.0) is None
    assert guard.charge_input(pings(1), 0.0) == CONTROL_FLOOD


# A frame on the wire as the budget sees it: its type, its payload's length, its stream.
FRAME_SHAPES = st.tuples(st.integers(0, 0x0A), st.integers(0, 300), st.integers(0, 2**31 - 1))


@given(
    frames=st.lists(FRAME_SHAPES, max_size=30),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    preface=st.booleans(),
)
def test_each_frame_is_charged_once_in_order_however_the_reads_are_cut(
    frames: list[tuple[int, int, int]], cuts: list[int], preface: bool
) -> None:
    """Headers read in place or pieced together across reads, payloads skipped in
    one read or many: the budget charges the same frames (type and stream), in
    wire order."""
    wire_bytes = (PREFACE if preface else b"") + b"".join(
        length.to_bytes(3, "big")
        + bytes([frame_type, 0])
        + stream.to_bytes(4, "big")
        + b"p" * length
        for frame_type, length, stream in frames
    )
    guard = ConnectionBudget(LIMITS, now=0.0)
    if not preface:
        guard.charge_input(PREFACE, 0.0)
    charged: list[tuple[int, int]] = []

    def charge(data: bytes, at: int, now: float) -> None:
        charged.append((data[at + 3], int.from_bytes(data[at + 5 : at + 9], "big")))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guard, "_charge_frame", charge)
        bounds = sorted({0, len(wire_bytes), *(cut % (len(wire_bytes) + 1) for cut in cuts)})
        for start, stop in itertools.pairwise(bounds):
            guard.charge_input(wire_bytes[start:stop], 0.0)
    assert charged == [(frame_type, stream) for frame_type, _, stream in frames]
