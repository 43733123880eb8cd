"""The Kubernetes side: credentials, the LIST + WATCH client, and the API emulator."""
