"""The per-connection HTTP/2 budgets (rpc/guard.py), frame by frame, with time passed in."""

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
    PREFACE,
    RAPID_RESET,
    ConnectionBudget,
    ProtocolLimits,
    ResetBudgets,
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
    budgets = ResetBudgets(limits)
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


def test_the_reset_budgets_forget_full_buckets_of_addresses_not_connected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ResetBudgets, "FORGET_ABOVE", 3)
    budgets = ResetBudgets(LIMITS)  # 10 resets a second, bursts of 20
    spent = budgets.of("127.0.0.2", 0.0)
    assert spent.take(0.0, 20)
    connected = budgets.of("127.0.0.3", 0.0)
    budgets.of("127.0.0.4", 0.0)
    assert len(budgets) == 3
    # One second later: .2 has half its burst back and is kept, .3 is full but
    # connected and kept, .4 is full and forgotten to make room for .5.
    budgets.of("127.0.0.5", 1.0, connected={"127.0.0.3"})
    assert len(budgets) == 3
    assert budgets.of("127.0.0.2", 1.0) is spent
    assert budgets.of("127.0.0.3", 1.0) is connected


# A frame on the wire as the budget sees it: its type and its payload's length.
FRAME_SHAPES = st.tuples(st.integers(0, 0x0A), st.integers(0, 300))


@given(
    frames=st.lists(FRAME_SHAPES, max_size=30),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    preface=st.booleans(),
)
def test_each_frame_is_charged_once_in_order_however_the_reads_are_cut(
    frames: list[tuple[int, int]], cuts: list[int], preface: bool
) -> None:
    """Headers read in place or pieced together across reads, payloads skipped in
    one read or many: the budget charges the same frames, in wire order."""
    wire_bytes = (PREFACE if preface else b"") + b"".join(
        length.to_bytes(3, "big") + bytes([frame_type, 0]) + b"\x00" * 4 + b"p" * length
        for frame_type, length in frames
    )
    guard = ConnectionBudget(LIMITS, now=0.0)
    if not preface:
        guard.charge_input(PREFACE, 0.0)
    charged: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guard, "_charge_frame", lambda frame_type, now: charged.append(frame_type))
        bounds = sorted({0, len(wire_bytes), *(cut % (len(wire_bytes) + 1) for cut in cuts)})
        for start, stop in itertools.pairwise(bounds):
            guard.charge_input(wire_bytes[start:stop], 0.0)
    assert charged == [frame_type for frame_type, _ in frames]
