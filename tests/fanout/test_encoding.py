"""`encode_signal` composes JobSummarySignal's bytes itself: held here to the generated
betterproto2 class, byte for byte, and to the generated parser."""

from __future__ import annotations

import dataclasses
from typing import Any

import betterproto2
from hypothesis import given
from hypothesis import strategies as st

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout.encoding import SIGNAL_FIELDS, encode_signal, signal_message
from jobsignal.store.model import SignalFields
from tests.support.factories import make_job

# Any text the store can emit: valid UTF-8, so no lone surrogates.
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
JOB_FIELDS = [field.name for field in dataclasses.fields(SignalFields)]


def test_the_field_table_is_the_generated_message() -> None:
    fields = dataclasses.fields(JobSummarySignal)
    assert tuple(field.name for field in fields) == SIGNAL_FIELDS
    for number, field in enumerate(fields, start=1):
        metadata = field.metadata["betterproto"]
        assert metadata.number == number
        assert metadata.proto_type == betterproto2.TYPE_STRING
        assert not metadata.repeated


@given(values=st.fixed_dictionaries({name: TEXT for name in JOB_FIELDS}), uuid=TEXT)
def test_equals_the_generated_encoding(values: dict[str, Any], uuid: str) -> None:
    job = dataclasses.replace(make_job(), **values)
    for strip in (False, True):
        expected = bytes(signal_message(job, uuid, strip_rank_table=strip))
        assert encode_signal(job, uuid, strip_rank_table=strip) == expected


def test_long_and_non_ascii_fields_round_trip() -> None:
    # Lengths of one, two and three varint bytes, and text of 2-, 3- and 4-byte characters.
    rank_table = '{"server_list":"' + "界" * 7_000 + '"}'
    job = make_job(3, hccl_json=rank_table, job_name="训练-🚀" * 50, operator="")
    parsed = JobSummarySignal.parse(encode_signal(job, "u-3"))
    assert parsed == signal_message(job, "u-3")
    assert parsed.hccl_json == rank_table
    assert parsed.operator == ""  # empty fields are left out, and read back as ""
    assert parsed.cm_index == "0"
