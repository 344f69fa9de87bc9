"""Writing a file so that no reader, and no kill, ever sees half of it.

`write_atomic` writes the new content under a hidden temporary name beside the target, flushes it to
disk and renames it over the target: a rename within one directory is atomic, so the path holds the
old content or the new, whole. Every side file a run keeps (train_config.json, history.json, the
checksums of its checkpoints, the CLI's outputs) goes through it.

It replaces only what a results file can be: nothing (a new file) or a regular file. A symbolic link is followed
to its target, which is written atomically in its own directory (the link stays a link, and reads the new
content). A directory, a device (/dev/full, /dev/null), a FIFO or a socket is refused with a ValueError before
anything is written: a rename would replace the node itself, and a reader of a FIFO would get nothing.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def write_atomic(path, data: bytes | str, *, durable: bool = True) -> Path:
    """Replaces `path` (missing, a regular file, or a symbolic link to either: its target) by `data` (str as UTF-8)
    through a temporary sibling and a rename, and returns the path written. durable=True also fsyncs the file
    before the rename and the directory after it (a power loss, not only a kill, then leaves one of the two
    versions). The file gets the umask's permissions, as any new file."""
    path = replaceable(path)
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


def replaceable(path) -> Path:
    """The file a write to `path` replaces: `path`, or the target of the symbolic link(s) it is; a ValueError if
    that is anything but missing or a regular file (module docstring), or a link that cannot be followed."""
    path = Path(path)
    target = path
    if path.is_symlink():
        try:
            target = path.resolve(strict=False)
        except (OSError, RuntimeError) as e:  # a loop of links
            raise ValueError(f"{path} is a symbolic link that cannot be followed ({e}): refusing to write there") from None
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ValueError(f"{path} cannot be examined ({e.strerror}): refusing to write there") from None
    kind = next((name for test, name in KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")
    if kind is not None:
        via = f" (the target of the link {path})" if target != path else ""
        raise ValueError(f"{target}{via} is {kind}: results are written only as a regular file (a new one, or one "
                         "replaced whole), never over anything else")
    return target


def fsync_path(path) -> None:
    """fsyncs a file or a directory (a directory's entries: the renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
