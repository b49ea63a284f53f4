"""What the store knows per session: its chain of chunks (index.py), versions and tombstones
(versions.py), retention (retention_table.py), truncation (truncation.py), the remote fetch that
opens a turn (remote_fetch.py, holds.py, origins.py) and the index rebuilt at start (restore.py).
"""
