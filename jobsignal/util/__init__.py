"""Small building blocks the layers share: a FIFO, text quoting, UUIDs, background
tasks for a block, backoff. Each module imports nothing of jobsignal's layers (and
this package imports none of them), so the pure store may use the pure ones."""
