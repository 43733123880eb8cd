"""The gRPC side: ClusterD's job.Job service, health and reflection on grpclib.

grpclib binds `asyncio.current_task` once, when `grpclib.utils` is first
imported; on Python 3.12 and later, trio-asyncio's tasks are found only by the
`current_task` that trio-asyncio installs when *it* is imported. So this
package imports trio_asyncio before anything of grpclib (the server and the
client both import it first), and refuses, with what to do, a process where
grpclib was bound earlier (`_grpclib.check_current_task`).
"""

import trio_asyncio  # noqa: F401  (first: grpclib must bind its asyncio.current_task)

from jobsignal.rpc import _grpclib

_grpclib.check_current_task()
