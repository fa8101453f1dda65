"""Data quality: checks on generated outputs, and server-configuration probes."""
