"""Writing a file so that no reader, and no kill, ever sees half of it.

`write_atomic` writes the new content under a hidden temporary name beside the target, flushes it to
disk and renames it over the target: a rename within one directory is atomic, so the path holds the
old content or the new, whole. Every side file a run keeps (train_config.json, history.json, the
checksums of its checkpoints, the CLI's outputs) goes through it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path, data: bytes | str, *, durable: bool = True) -> Path:
    """Replaces `path` by `data` (str as UTF-8) through a temporary sibling and a rename. durable=True
    also fsyncs the file before the rename and the directory after it (a power loss, not only a kill,
    then leaves one of the two versions). The file gets the umask's permissions, as any new file."""
    path = Path(path)
    content = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(content)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(path.parent)
    return path


def fsync_path(path) -> None:
    """fsyncs a file or a directory (a directory's entries: the renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
