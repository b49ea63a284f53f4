"""Replace a small file holding secrets or their state atomically, mode 0600, durably.

Used for the server secret, the shred list and re-seal cursor (store/sealing) and the API keys
file (api/key_file.py): a reader never sees a torn file, a crash never loses a completed write
(the file and the rename are fsynced), and the file is 0600 whatever the umask or an old tmp
file's mode. The tmp name carries the pid, so two processes writing the same file never share
one; O_NOFOLLOW refuses a tmp path someone made a symlink.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: bytes | str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, raw)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
