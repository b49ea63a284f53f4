"""What the store knows per session: its chain of chunks (index.py), versions and tombstones
(versions.py), retention (retention_table.py), truncation (truncation.py), the remote fetch that
opens a turn (turn_opening.py, holds.py) and the index rebuilt at start (restore.py).
"""
