"""The Kubernetes side: credentials and the LIST + WATCH client (emulator: `jobsignal.sim`)."""
