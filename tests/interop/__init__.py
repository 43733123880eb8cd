"""Interop with gRPC clients in other languages: grpc-go and grpc-js, built and run here.

The peers' toolchains (Node.js, Go, grpc-go's sources) are installed without
root by `nox -s peers` (bench/toolchains.py); `peers.py` builds and runs the
peers (tests/interop/go, tests/interop/js). A peer that could not be had is
reported as not run, or failed in CI (tests/support/peers_needed.py).
"""
