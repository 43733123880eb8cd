"""The relay source: another `job.Job` server (ClusterD or a jobsignal) as the source of jobs.

`jobsignal serve --source relay --upstream HOST:PORT` subscribes to the
upstream with the List RPC and serves what it receives to its own
subscribers as if it had read the ConfigMaps (docs/architecture.md section 4,
"Relaying another server"): wire.py reads the upstream's messages, state.py
(pure) holds the relayed jobs, upstream.py is the gRPC client on h2 and trio,
source.py follows the subscription behind the watch-source interface.
Nothing is imported here, so the pure modules load without the others.
"""
