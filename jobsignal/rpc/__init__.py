"""The gRPC side: ClusterD's job.Job service, health and reflection on grpclib."""
