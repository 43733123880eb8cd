"""The relay source: another `job.Job` server (ClusterD or a jobsignal) as the source of jobs.

`jobsignal serve --source relay --upstream HOST:PORT` subscribes to the
upstream with the List RPC and serves what it receives to its own
subscribers as if it had read the ConfigMaps (docs/architecture.md section 4,
"Relaying another server"): wire.py reads the upstream's messages, state.py
(pure) holds the relayed jobs, upstream.py is the gRPC client on h2 and trio,
source.py follows the subscription behind the watch-source interface.
"""

from jobsignal.relay.settings import RelaySettings
from jobsignal.relay.source import Relay, RelayCounters, stream_opener
from jobsignal.relay.state import RelayedJobs

__all__ = ["Relay", "RelayCounters", "RelaySettings", "RelayedJobs", "stream_opener"]
