"""Interop with gRPC clients in other languages: grpc-go and grpc-js, built and run here.

The peers (tests/interop/go, tests/interop/js) are installed by
`.ci/install-peers`; `peers.py` builds and runs them, and fails the session
with the missing package's name when they cannot be built.
"""
