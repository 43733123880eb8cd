"""Wire encoding of job events: done once per event, shared by every subscriber.

`JobSummarySignal` is encoded by the generated betterproto2 class. A
`JobSummarySignalList` is composed from already-encoded signals: a repeated
message field is just each element's bytes behind a tag and a length, so a
snapshot of thousands of jobs costs a byte join instead of thousands of
re-encodes (tests/fanout/test_fanout.py::test_composed_list_equals_generated_encoding
checks it against the generated parser).
"""

from __future__ import annotations

from collections.abc import Sequence

from jobsignal._proto.job import JobSummarySignal
from jobsignal.store.model import JobSummary

# Field tags of JobSummarySignalList: (field number << 3) | wire type.
_TAG_SIGNALS = b"\x0a"  # field 1, length-delimited
_TAG_REPORT_TIME = b"\x12"  # field 2, length-delimited
_TAG_TOTAL = b"\x18"  # field 3, varint


def signal_message(
    job: JobSummary, uuid: str, *, strip_rank_table: bool = False
) -> JobSummarySignal:
    return JobSummarySignal(
        uuid=uuid,
        job_id=job.job_id,
        job_name=job.job_name,
        namespace=job.namespace,
        frame_work=job.framework,
        job_status=job.job_status,
        time=job.time,
        cm_index="0",
        total=job.total,
        hccl_json="" if strip_rank_table else job.hccl_json,
        delete_time=job.delete_time,
        shared_tor_ip=job.shared_tor_ip,
        master_addr=job.master_addr,
        operator=job.operator,
        sid=job.sid,
    )


def encode_signal(job: JobSummary, uuid: str, *, strip_rank_table: bool = False) -> bytes:
    return bytes(signal_message(job, uuid, strip_rank_table=strip_rank_table))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_signal_list(signals: Sequence[bytes], report_time_ms: int, job_total: int) -> bytes:
    """Encode a JobSummarySignalList from encoded JobSummarySignal messages."""
    parts: list[bytes] = []
    for signal in signals:
        parts += (_TAG_SIGNALS, _varint(len(signal)), signal)
    report_time = str(report_time_ms).encode()
    parts += (_TAG_REPORT_TIME, _varint(len(report_time)), report_time)
    if job_total:  # proto3 leaves zero scalars out
        parts += (_TAG_TOTAL, _varint(job_total))
    return b"".join(parts)
