"""The upstream's `job.Job` messages on the wire: decoded and checked here, pure.

A relay's upstream is a network peer like any other (docs/architecture.md
section 7), so its messages are read by hand, not by the generated classes:
a `JobSummarySignalList` is taken apart into its signals' bytes first, so a
malformed signal costs only itself (its job is rejected; the batch, and the
JobTotalNum the snapshot is counted against, stand), and every string is
checked to be UTF-8 as it is decoded. Anything else raises `Malformed`, whose
`reason` is a metric label (`REASONS`, beside the store's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from jobsignal.store.configmap import BadConfigMap

#: Every reason a message or a signal is refused (on top of the store's checks of
#: the job's fields: store/configmap.py REASONS); a metric label.
REASONS = {
    "bad_protobuf": "not a well-formed protobuf message of the expected type",
    "not_utf8": "a string field that is not valid UTF-8",
    "bad_total": "a JobTotalNum that is negative or above the relay's bound",
    "bad_uuid": "a uuid over 64 characters",
}

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5

#: JobSummarySignal's fields by number (protos/job/job.proto), named as JobSummary's.
SIGNAL_FIELDS = {
    1: "uuid",
    2: "job_id",
    3: "job_name",
    4: "namespace",
    5: "framework",
    6: "job_status",
    7: "time",
    8: "cm_index",
    9: "total",
    10: "hccl_json",
    11: "delete_time",
    12: "shared_tor_ip",
    13: "master_addr",
    14: "operator",
    15: "sid",
}


class Malformed(BadConfigMap):
    """A message or signal that cannot be read; `reason` is a key of `REASONS`. A
    kind of the store's rejection, so a relayed job's faults are all of one type."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 70:
        if pos >= len(data):
            raise Malformed("bad_protobuf", "a varint runs past the end")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise Malformed("bad_protobuf", "a varint of more than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field: an int, or the bytes of a
    length-delimited one. Groups (wire types 3, 4) and field number 0 are malformed."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise Malformed("bad_protobuf", "field number 0")
        if kind == _VARINT:
            value, pos = _varint(data, pos)
            yield number, kind, value
        elif kind == _BYTES:
            length, pos = _varint(data, pos)
            if length > end - pos:
                raise Malformed("bad_protobuf", f"a field of {length} bytes runs past the end")
            yield number, kind, data[pos : pos + length]
            pos += length
        elif kind in (_FIXED64, _FIXED32):
            size = 8 if kind == _FIXED64 else 4
            if size > end - pos:
                raise Malformed("bad_protobuf", "a fixed-size field runs past the end")
            yield number, kind, int.from_bytes(data[pos : pos + size], "little")
            pos += size
        else:
            raise Malformed("bad_protobuf", f"wire type {kind}")


def _text(number: int, kind: int, value: int | bytes) -> str:
    if kind != _BYTES or not isinstance(value, bytes):
        raise Malformed("bad_protobuf", f"field {number} is not length-delimited")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("not_utf8", f"field {number} is not valid UTF-8") from None


def _int32(number: int, kind: int, value: int | bytes) -> int:
    if kind != _VARINT or not isinstance(value, int):
        raise Malformed("bad_protobuf", f"field {number} is not a varint")
    value &= 0xFFFFFFFF  # int32: the low 32 bits, as protobuf truncates
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass(frozen=True, slots=True)
class SignalList:
    """A `JobSummarySignalList`: its signals still encoded, ReportTime, JobTotalNum."""

    signals: list[bytes]
    report_time: str
    job_total: int


def decode_list(data: bytes) -> SignalList:
    signals: list[bytes] = []
    report_time, job_total = "", 0
    for number, kind, value in fields(data):
        if number == 1:
            if kind != _BYTES or not isinstance(value, bytes):
                raise Malformed("bad_protobuf", "jobSummarySignals is not length-delimited")
            signals.append(value)
        elif number == 2:
            report_time = _text(number, kind, value)
        elif number == 3:
            job_total = _int32(number, kind, value)
        # Unknown fields are skipped, as protobuf does.
    if job_total < 0:
        raise Malformed("bad_total", f"JobTotalNum {job_total}")
    return SignalList(signals, report_time, job_total)


def decode_signal(data: bytes) -> dict[str, str]:
    """A `JobSummarySignal`'s string fields by name (`SIGNAL_FIELDS`); absent ones are ""."""
    values = dict.fromkeys(SIGNAL_FIELDS.values(), "")
    for number, kind, value in fields(data):
        name = SIGNAL_FIELDS.get(number)
        if name is not None:
            values[name] = _text(number, kind, value)  # a repeated field: the last wins
    return values


@dataclass(frozen=True, slots=True)
class Status:
    """A `Status`, Register's answer."""

    code: int
    info: str
    client_id: str


def decode_status(data: bytes) -> Status:
    code, info, client_id = 0, "", ""
    for number, kind, value in fields(data):
        if number == 1:
            code = _int32(number, kind, value)
        elif number == 2:
            info = _text(number, kind, value)
        elif number == 3:
            client_id = _text(number, kind, value)
    return Status(code, info, client_id)


def _length_delimited(number: int, text: str) -> bytes:
    data = text.encode()
    key, length = (number << 3) | _BYTES, len(data)
    prefix = bytearray((key,))
    while length >= 0x80:
        prefix.append((length & 0x7F) | 0x80)
        length >>= 7
    prefix.append(length)
    return bytes(prefix) + data


def encode_client_info(role: str, client_id: str = "") -> bytes:
    """A `ClientInfo` (role = 1, clientId = 3); empty fields left out, as proto3 does."""
    parts = [_length_delimited(1, role)] if role else []
    if client_id:
        parts.append(_length_delimited(3, client_id))
    return b"".join(parts)
