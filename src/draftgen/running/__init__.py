"""A run: the runner sets it up, dispatch decides what to send where, each request task
streams, retries and records; the monitor, stats, progress and metrics watch it."""
