"""A simulated cluster for `jobsignal demo`, the tests and the benchmarks: a
Kubernetes API emulator (`emulator`) that follows the real API's rules, and a
ClusterD-like writer of job-summary ConfigMaps (`clusterd`, `demo`).

Shipped with the package for `jobsignal demo`; the real Kubernetes client in
`jobsignal.kube` never imports it (an import-linter contract checks that).
"""
