"""The codec refuses exactly the requests it refused with protobuf's parser.

The server decodes ClientInfo and HealthCheckRequest with betterproto2 and
checks their framing itself (jobsignal/rpc/codec.py), without the protobuf
runtime. It used to parse each request with protobuf first (built from the
descriptor reflection serves), then with betterproto2: that pair is the
reference here. For hand-picked malformed messages and thousands of random
ones (valid fields, broken fields, truncations), the codec answers
INVALID_ARGUMENT if and only if one of the two raises.

One rule of the wire format protobuf's parser does not apply in every release:
field number 0 is invalid. upb (protobuf's Python runtime) up to 6.33 refuses it
inside a group as elsewhere; from 7.34 it skips a group's fields unchecked. The
reference holds every release to the rule: beyond the parse, no field protobuf
read (its unknown fields, into nested groups) may have number 0.
"""

from __future__ import annotations

import random

import pytest
from google.protobuf import message_factory
from google.protobuf.unknown_fields import UnknownFieldSet
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from jobsignal._proto.grpc.health.v1 import HealthCheckRequest
from jobsignal._proto.job import ClientInfo
from jobsignal.rpc.codec import PassthroughCodec
from jobsignal.rpc.reflection import own_pool

REFERENCE = message_factory.GetMessageClass(own_pool().FindMessageTypeByName("job.ClientInfo"))
CODEC = PassthroughCodec(max_request_bytes=1 << 20)


def has_field_number_0(fields: UnknownFieldSet) -> bool:
    """Whether protobuf read a field number 0 among `fields` or in a group of them."""
    return any(
        field.field_number == 0 or (field.wire_type == 3 and has_field_number_0(field.data))
        for field in fields
    )


def reference_accepts(data: bytes, message_type: type = ClientInfo) -> bool:
    try:
        parsed = REFERENCE.FromString(data)
        message_type().parse(data)
    except Exception:
        return False
    return not has_field_number_0(UnknownFieldSet(parsed))


def codec_accepts(data: bytes, message_type: type = ClientInfo) -> bool:
    try:
        CODEC.decode(data, message_type)
    except GRPCError as error:
        assert error.status is Status.INVALID_ARGUMENT
        return False
    return True


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def group(number: int, depth: int) -> bytes:
    return varint(number << 3 | 3) * depth + varint(number << 3 | 4) * depth


CASES = {
    "valid": b"\x0a\x03abc\x1a\x01x",
    "string past the end": b"\x0a\x05abc",
    "unknown field past the end": b"\x22\x05ab",
    "length far past the end": b"\x22\xff\xff\xff\xff\x0f",
    "truncated varint": b"\x20\x80",
    "varint of 10 bytes": b"\x20" + b"\xff" * 9 + b"\x01",
    "varint of 11 bytes": b"\x20" + b"\xff" * 10 + b"\x01",
    "fixed32 cut short": b"\x2d\x01\x02",
    "fixed64 cut short": b"\x29\x01",
    "wire type 6": b"\x0e",
    "wire type 7": b"\x0f",
    "field number 0": b"\x02\x00",
    "highest field number": varint((2**29 - 1) << 3) + b"\x00",
    "tag above 32 bits": b"\xf8\xff\xff\xff\x7f\x00",
    "END_GROUP outside a group": b"\x0c",
    "group": b"\x13\x08\x01\x14",
    "unterminated group": b"\x13\x08\x01",
    "group ended with another number": b"\x13\x08\x01\x1c",
    "groups nested 100 deep": group(2, 100),
    "groups nested 101 deep": group(2, 101),
    "tag of 6 bytes": b"\x88\x80\x80\x80\x80\x00\x01",
    "field number 0 in a group": b"\x23\x00\x01\x03\x04\x24",
    "wire type 6 in a group": b"\x23\x0e\x24",
    "tag above 32 bits in a group": b"\x23\xf8\xff\xff\xff\x7f\x00\x24",
    "known string as a varint": b"\x08\x01",
    "invalid UTF-8 in a string": b"\x0a\x01\xff",
}


@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
def test_malformed_requests_are_refused_as_before(data: bytes) -> None:
    for message_type in (ClientInfo, HealthCheckRequest):
        assert codec_accepts(data, message_type) == reference_accepts(data, message_type)


def random_field(rng: random.Random) -> bytes:
    number = rng.choice([1, 2, 3, 4, 15, 16, 2047, 2**29 - 1, 0])
    wire_type = rng.choice([0, 1, 2, 2, 3, 4, 5, 6, 7])
    tag = varint(number << 3 | wire_type)
    if wire_type == 0:
        return tag + varint(rng.getrandbits(rng.choice([1, 7, 32, 64])))
    if wire_type == 1:
        return tag + rng.randbytes(8)
    if wire_type == 5:
        return tag + rng.randbytes(4)
    if wire_type == 2:
        body = rng.choice([b"", b"role", "é".encode(), rng.randbytes(rng.randint(0, 6))])
        return tag + varint(len(body) + rng.choice([0, 0, 0, 1, -1 if body else 0])) + body
    if wire_type == 3:
        inner = b"".join(random_field(rng) for _ in range(rng.randint(0, 2)))
        return tag + inner + varint(number << 3 | 4) * rng.choice([1, 1, 0])
    return tag


def test_random_requests_are_refused_as_before() -> None:
    rng = random.Random(20261201)
    refused = 0
    for _ in range(4000):
        data = b"".join(random_field(rng) for _ in range(rng.randint(0, 4)))
        if rng.random() < 0.2 and data:
            data = data[: rng.randrange(len(data))]
        expected = reference_accepts(data)
        assert codec_accepts(data) == expected, data
        refused += not expected
    assert 500 < refused < 3500  # both kinds were tried
