"""The gRPC side: ClusterD's job.Job service, health and reflection on grpclib.

Importing it installs the grpclib adapter (`_grpclib.install`), before any grpclib
handler or call runs on trio-asyncio: the server and the client both import it.
"""

from jobsignal.rpc import _grpclib

_grpclib.install()
