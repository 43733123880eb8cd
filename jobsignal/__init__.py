"""jobsignal: stream Ascend job-summary ConfigMaps to ClusterD-compatible gRPC clients."""

__version__ = "0.1.0"
