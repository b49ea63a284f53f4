"""How a turn's chunks reach the tiers: the turn commit (turn_commit.py), the write buffer that
runs it on the writer thread (write_buffer.py), and the write-back to LMDB (persister.py)."""
