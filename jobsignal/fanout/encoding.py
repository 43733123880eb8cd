"""Wire encoding of job events: done once per event, shared by every subscriber.

Both messages are composed here from their fields' bytes, and the generated
betterproto2 classes are the reference the tests hold them to
(tests/fanout/test_encoding.py: byte for byte, and through the generated
parser):

- every field of a `JobSummarySignal` is a string, so the message is each
  non-empty field's UTF-8 behind its tag and length, in field order, as
  proto3 writes it: a join of byte strings instead of the generated class's
  reflective encoder (about ten times slower, and on every event's path
  from the watch to the first subscriber, and on every job of a snapshot);
- a `JobSummarySignalList` is composed from already-encoded signals: a
  repeated message field is just each element's bytes behind a tag and a
  length, so a snapshot of thousands of jobs costs a byte join instead of
  thousands of re-encodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from jobsignal._proto.job import JobSummarySignal
from jobsignal.store.model import JobSummary

# JobSummarySignal's fields in field-number order (protos/job.proto, 1 to 15), all
# strings: (field number << 3) | 2 (length-delimited) is each one's tag.
SIGNAL_FIELDS = (
    "uuid",
    "job_id",
    "job_name",
    "namespace",
    "frame_work",
    "job_status",
    "time",
    "cm_index",
    "total",
    "hccl_json",
    "delete_time",
    "shared_tor_ip",
    "master_addr",
    "operator",
    "sid",
)
_SIGNAL_TAGS = tuple(bytes(((number << 3) | 2,)) for number in range(1, len(SIGNAL_FIELDS) + 1))
# A job's events always carry cmIndex "0" (one message per job, never per ConfigMap).
_CM_INDEX = "0"

# Field tags of JobSummarySignalList: (field number << 3) | wire type.
_TAG_SIGNALS = b"\x0a"  # field 1, length-delimited
_TAG_REPORT_TIME = b"\x12"  # field 2, length-delimited
_TAG_TOTAL = b"\x18"  # field 3, varint


def signal_message(
    job: JobSummary, uuid: str, *, strip_rank_table: bool = False
) -> JobSummarySignal:
    """The event as the generated message (what `encode_signal` must encode to)."""
    return JobSummarySignal(
        uuid=uuid,
        job_id=job.job_id,
        job_name=job.job_name,
        namespace=job.namespace,
        frame_work=job.framework,
        job_status=job.job_status,
        time=job.time,
        cm_index=_CM_INDEX,
        total=job.total,
        hccl_json="" if strip_rank_table else job.hccl_json,
        delete_time=job.delete_time,
        shared_tor_ip=job.shared_tor_ip,
        master_addr=job.master_addr,
        operator=job.operator,
        sid=job.sid,
    )


def encode_signal(job: JobSummary, uuid: str, *, strip_rank_table: bool = False) -> bytes:
    """The encoded `JobSummarySignal` of this event, equal to `bytes(signal_message(...))`."""
    values = (
        uuid,
        job.job_id,
        job.job_name,
        job.namespace,
        job.framework,
        job.job_status,
        job.time,
        _CM_INDEX,
        job.total,
        "" if strip_rank_table else job.hccl_json,
        job.delete_time,
        job.shared_tor_ip,
        job.master_addr,
        job.operator,
        job.sid,
    )
    parts: list[bytes] = []
    for tag, value in zip(_SIGNAL_TAGS, values, strict=True):
        if value:  # proto3 leaves empty strings out
            data = value.encode()
            parts += (tag, _varint(len(data)), data)
    return b"".join(parts)


_ONE_BYTE = tuple(bytes((value,)) for value in range(0x80))


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
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
