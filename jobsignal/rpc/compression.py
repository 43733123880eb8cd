"""Compressed requests: the encodings a client may compress its messages with, read
within the request size limit.

gRPC lets a client compress the messages it sends: the request's
`grpc-encoding` header names the algorithm and each compressed message says
so in the flag of its 5-byte prefix (a client may still send any message
uncompressed). grpcio does it with a channel's `compression=`, grpc-go with
`grpc.UseCompressor`, grpc-js with `grpc.default_compression_algorithm`.
This server reads gzip and deflate, as grpcio's server and grpc-go's (with
its gzip package) do; its responses are never compressed. The statuses are
those of grpc-go's and gRPC core's servers (docs/architecture.md section 7,
"Request bodies").
"""

from __future__ import annotations

import zlib

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from jobsignal.util.text import quote

# zlib's window bits for each encoding: gzip with its header and trailer, and
# deflate in the zlib format (RFC 1950), as gRPC core and grpc-java send it.
_WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPTED_ENCODINGS = "identity, " + ", ".join(sorted(_WINDOW_BITS))
# A header value echoed in a refusal is cut to this many characters.
_ECHOED_CHARS = 40


def check_encoding(encoding: str | None) -> str:
    """The encoding of a message flagged compressed: one this server reads, else
    UNIMPLEMENTED (naming the ones it reads), or INTERNAL when the request named
    none or identity, under which no message may be compressed."""
    if encoding is None or encoding == "identity":
        raise GRPCError(
            Status.INTERNAL,
            f"request message is flagged compressed, but its grpc-encoding is"
            f" {encoding or 'missing'}",
        )
    if encoding not in _WINDOW_BITS:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"grpc-encoding {quote(encoding, _ECHOED_CHARS)} is not supported;"
            f" this server reads {ACCEPTED_ENCODINGS}",
        )
    return encoding


def decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """One compressed message, whole: RESOURCE_EXHAUSTED as soon as it would come to
    more than `limit` bytes (no more is ever inflated), INTERNAL when it is not
    one complete stream of `encoding` (`check_encoding` returned it)."""
    decompressor = zlib.decompressobj(_WINDOW_BITS[encoding])
    try:
        message = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise _not_valid(encoding, str(exc)) from None
    if len(message) > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request decompresses to more than the limit of {limit} bytes",
        )
    if not decompressor.eof:
        raise _not_valid(encoding, "it is cut short")
    if decompressor.unused_data:
        raise _not_valid(encoding, "bytes follow its end")
    return message


def _not_valid(encoding: str, why: str) -> GRPCError:
    return GRPCError(Status.INTERNAL, f"request message is not valid {encoding}: {why}")
