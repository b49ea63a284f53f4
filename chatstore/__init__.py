"""chatstore: a multi-turn chat server that keeps each session's KV cache across turns."""

__version__ = "0.1.0"
