"""Integration tests of the job.Job gRPC server against the official grpcio client.

Everything here runs over real loopback sockets (127.0.0.1) on the real
clock: grpclib's timers use `time.monotonic()`, so waits are short and every
one of them is bounded. The grpcio client is blocking and runs in worker
threads; the server runs on the trio thread, which is never blocked. The
helpers are in tests/support/ (`grpc_server`, `grpcio`, `h2_client`).
"""
