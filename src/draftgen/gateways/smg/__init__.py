"""The SGLang Model Gateway: its API, what it relays of its workers, and its `Gateway`."""
