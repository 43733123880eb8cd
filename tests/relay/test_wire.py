"""The upstream's messages read by hand (jobsignal/relay/wire.py), held to the generated classes."""

from __future__ import annotations

import pytest

from jobsignal._proto.job import ClientInfo, JobSummarySignal, JobSummarySignalList, Status
from jobsignal.fanout.encoding import encode_signal, encode_signal_list, signal_message
from jobsignal.relay.wire import (
    Malformed,
    decode_list,
    decode_signal,
    decode_status,
    encode_client_info,
)
from tests.support.factories import make_job


def test_a_list_comes_apart_into_its_signals_report_time_and_total() -> None:
    jobs = [make_job(1), make_job(2, status="complete")]
    signals = [encode_signal(job, f"uuid-{job.job_id}") for job in jobs]
    batch = decode_list(encode_signal_list(signals, 1_700_000_000_123, 7))
    assert batch.signals == signals
    assert (batch.report_time, batch.job_total) == ("1700000000123", 7)


def test_a_signal_decodes_to_every_field_as_the_generated_class_reads_it() -> None:
    job = make_job(3, operator="delete")
    data = bytes(signal_message(job, "the-uuid"))
    values = decode_signal(data)
    parsed = JobSummarySignal.parse(data)
    assert values["uuid"] == parsed.uuid == "the-uuid"
    assert values["framework"] == parsed.frame_work == job.framework
    assert values["hccl_json"] == job.hccl_json
    assert values["cm_index"] == "0"
    assert {k: v for k, v in values.items() if k not in ("uuid", "cm_index")} == {
        name: getattr(job, name) for name in values if name not in ("uuid", "cm_index")
    }


def test_empty_messages_are_all_defaults() -> None:
    assert decode_list(b"").signals == []
    assert decode_list(b"").job_total == 0
    assert set(decode_signal(b"").values()) == {""}


def test_unknown_fields_are_skipped() -> None:
    # Fields 20 (varint), 21 (bytes), 22 (fixed32), 23 (fixed64): keys of two bytes.
    extra = b"\xa0\x01\x05" + b"\xaa\x01\x03abc" + b"\xb5\x01" + bytes(4) + b"\xb9\x01" + bytes(8)
    signal = encode_signal(make_job(1), "u")
    batch = decode_list(extra + encode_signal_list([signal], 1, 1))
    assert batch.signals == [signal]
    assert decode_signal(extra + signal)["uuid"] == "u"


def test_a_negative_job_total_num_is_refused() -> None:
    data = bytes(JobSummarySignalList(job_total_num=-1))
    with pytest.raises(Malformed) as raised:
        decode_list(data)
    assert raised.value.reason == "bad_total"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x0a\x05ab", "bad_protobuf"),  # a field longer than what is left
        (b"\x18" + b"\xff" * 11, "bad_protobuf"),  # an endless varint
        (b"\x18", "bad_protobuf"),  # a varint cut off
        (b"\x03", "bad_protobuf"),  # wire type 3 (a group)
        (b"\x02\x00", "bad_protobuf"),  # field number 0
        (b"\x12\x02\xc3\x28", "not_utf8"),  # ReportTime, not UTF-8
        (b"\x10\x01", "bad_protobuf"),  # ReportTime as a varint
        (b"\x0d\x00\x00\x00\x00", "bad_protobuf"),  # a signal as a fixed32
    ],
)
def test_malformed_lists_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(Malformed) as raised:
        decode_list(data)
    assert raised.value.reason == reason


def test_a_signal_with_a_string_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(Malformed) as raised:
        decode_signal(b"\x22\x02\xed\xb2")  # namespace: half a surrogate's encoding
    assert raised.value.reason == "not_utf8"


def test_register_answers_and_requests_match_the_generated_classes() -> None:
    answer = bytes(Status(code=200, info="registration successful", client_id="abc"))
    status = decode_status(answer)
    assert (status.code, status.info, status.client_id) == (200, "registration successful", "abc")
    assert decode_status(bytes(Status(code=-5))).code == -5
    assert encode_client_info("DefaultUser2") == bytes(ClientInfo(role="DefaultUser2"))
    long_id = "x" * 200  # a length of two varint bytes
    assert encode_client_info("CCAgent", long_id) == bytes(
        ClientInfo(role="CCAgent", client_id=long_id)
    )
