"""The support library of the tests: helpers imported as `tests.support.<module>`.

- `waiting`: `wait_until` (and `wait_until_blocking`), the one way to wait for a condition;
- `threads`: `in_thread`, the one bridge to blocking calls;
- `grpcio`: the official grpcio client (stubs, channels) and `GrpcioStream`, the one
  reader of its response streams; `grpcio_cli`: its clients run out of process;
- `factories`: `make_job`, `clusterd_job` and `configmap`, the test data;
- `grpc_server`: jobsignal's gRPC server on its own (`open_jobsignal_server`);
- `h2_client`: raw HTTP/2 requests grpcio won't send;
- `cluster`, `events`, `watching`: the emulated cluster, what a client saw of it,
  and a watcher on the emulator;
- `kube_server`: the whole server against the emulator (`open_kube_server`);
- `tls`, `metrics`: certificates made in the test; scraping a metrics port.

Shared fixtures (`grpcio_stubs`, `grpc_clients`, `ca`, `emu`, `io_clock`) are in
tests/conftest.py.
"""
