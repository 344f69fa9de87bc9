"""Filesystem safety of a conversion: where it may write, how it replaces, what it may delete.

A conversion into `<parent>/<name>` works in hidden siblings named after the writing process:

  .<name>.tmp-<pid>.<start>@<host>-<token>   the new tree while it is written (complete once it holds
                                             the manifest); renamed to <name> at the end
  .<name>.old-<pid>.<start>@<host>-<token>   an existing <name> moved aside by overwrite=True, removed last

(<start>: the process's start time in clock ticks since boot, from /proc; absent where there is no /proc.
A pid alone cannot say a writer is gone: the kernel reuses pids, and threads draw from the same numbers.)

A sibling holds `.dllm_jax_writer.json` while its writer owns it; that file says which files the
writer may delete (all of a new tree; only the manifest's files of an old one) and is deleted last.
A conversion killed at any point leaves <name> as it was (absent or the old complete tree), the
new complete tree, or absent (only between the two renames of an overwrite), plus such siblings.
The next conversion into the same parent removes the siblings whose process is gone (the pid is
not running on this host, or names a process started at another time), deleting only the files
they record, and warns about each removal and about the siblings it cannot judge (a live pid,
another host, contents it did not write): a live pid may be a conversion in progress, and another
host's pid says nothing here. It removes rather than reports dead ones because they are only ever
leftovers (a complete tree in one was either replaced by request or is redone by running the killed
conversion again) and cost disk space.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import warnings
from pathlib import Path

from dllm_jax.checkpoint.manifest import MANIFEST, files_under, read_manifest
from dllm_jax.files import fsync_path

WRITER = ".dllm_jax_writer.json"
SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:\.(?P<start>\d+))?@(?P<host>[^/]+)"
                     r"-(?P<token>[0-9a-f]{8})$")
MAX_LISTED = 20


def sibling_name(out_dir: Path, kind: str) -> Path:
    start = process_start(os.getpid())
    writer = f"{os.getpid()}" + ("" if start is None else f".{start}")
    return out_dir.parent / f".{out_dir.name}.{kind}-{writer}@{socket.gethostname()}-{secrets.token_hex(4)}"


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat's 22nd field); None if unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def make_temp_tree(out_dir: Path) -> Path:
    """Creates the hidden sibling a new tree is written into, owned by this process. os.mkdir with
    0o777 leaves the permissions to the umask (tempfile.mkdtemp would force 0700)."""
    tmp = sibling_name(out_dir, "tmp")
    os.mkdir(tmp, 0o777)
    try:
        write_writer(tmp, files=None)
    except BaseException:  # a full disk, say: leave no empty sibling behind
        with contextlib.suppress(OSError):
            (tmp / WRITER).unlink(missing_ok=True)
            os.rmdir(tmp)
        raise
    return tmp


def write_writer(directory: Path, *, files) -> None:
    """Marks `directory` as owned by this process; `files` None: every file in it is ours."""
    record = dict(pid=os.getpid(), host=socket.gethostname(), files=None if files is None else sorted(files))
    (directory / WRITER).write_text(json.dumps(record) + "\n")


def check_separate(hf_dir: Path, out_dir: Path, sources) -> None:
    """ValueError if out_dir is, is inside, or contains the source checkpoint: hf_dir or a directory
    that really holds one of its files (`sources`, symlinks resolved, as in a Hugging Face cache)."""
    out_real = out_dir.resolve()
    source_dirs = {hf_dir.resolve()} | {Path(f).resolve().parent for f in sources}
    for source in sorted(source_dirs):
        relation = path_relation(out_real, source)
        if relation:
            where = "" if source == hf_dir.resolve() else f" (its files live in {source})"
            raise ValueError(f"out_dir {out_dir} (resolved: {out_real}) {relation} the source checkpoint "
                             f"{hf_dir}{where}: choose an out_dir outside the source")


def path_relation(path, other) -> str | None:
    """How `path` lies to `other` once both are resolved (symlinks followed): "is", "is inside",
    "contains", or None when they are apart. The one rule for every writer that must keep off a source."""
    path, other = Path(path).resolve(), Path(other).resolve()
    return ("is" if path == other else "is inside" if path.is_relative_to(other)
            else "contains" if other.is_relative_to(path) else None)


def check_replaceable(out_dir: Path) -> None:
    """ValueError unless out_dir is a committed conversion holding only files that conversion wrote,
    so that overwrite=True deletes nothing it did not write."""
    if out_dir.is_symlink():
        raise ValueError(f"out_dir {out_dir} is a symbolic link (to {os.readlink(out_dir)}): pass the directory "
                         "it points to, or remove the link")
    if not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} exists and is not a directory: refusing to overwrite it")
    if not (out_dir / MANIFEST).is_file():
        raise ValueError(f"refusing to overwrite {out_dir}: it is not a committed dllm_jax conversion (no "
                         f"{MANIFEST}), so its files are not known to be the converter's. Remove it yourself "
                         "if it is meant to go")
    try:
        manifest = read_manifest(out_dir)
    except ValueError as e:
        raise ValueError(f"refusing to overwrite {out_dir}: {e}. Remove it yourself if it is meant to go") from e
    foreign = sorted(set(files_under(out_dir)) - set(manifest.files) - {MANIFEST})
    if foreign:
        raise ValueError(f"refusing to overwrite {out_dir}: it holds {len(foreign)} files the conversion did not "
                         f"write: {foreign[:MAX_LISTED]}{' ...' if len(foreign) > MAX_LISTED else ''}. Move them "
                         "away or remove them yourself")


def replace_tree(new: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Moves the complete tree `new` to out_dir. An existing out_dir (overwrite=True; checked again
    here, as minutes may have passed since the first check) is renamed aside first and removed last,
    so a kill leaves either tree whole (or out_dir absent between the two renames, both trees whole
    beside it). Without overwrite an out_dir that appeared meanwhile is refused, not replaced."""
    parent = out_dir.parent
    (new / WRITER).unlink()  # the manifest now vouches for the tree; the writer file is not part of it
    if not (out_dir.exists() or out_dir.is_symlink()):
        try:
            os.rename(new, out_dir)  # fails on a non-empty directory that appeared since the check
        except OSError as e:
            raise ValueError(f"{out_dir} appeared while converting (another conversion?); not replacing it: "
                             f"{e.strerror or e}") from e
        fsync_path(parent)
        return
    if not overwrite:
        raise ValueError(f"{out_dir} appeared while converting (another conversion?); not replacing it")
    check_replaceable(out_dir)
    aside = sibling_name(out_dir, "old")
    os.rename(out_dir, aside)
    os.rename(new, out_dir)
    fsync_path(parent)
    left = remove_tree(aside, files=(*read_manifest(aside).files, MANIFEST))
    if left:  # written into the old tree after check_replaceable: kept, never deleted
        warnings.warn(f"kept {aside} (the replaced tree): it holds files the conversion did not write: "
                      f"{left[:MAX_LISTED]}", stacklevel=3)


def remove_tree(directory: Path, *, files=None) -> list[str]:
    """Deletes the files of `directory` that its writer wrote (`files`; None: all), then the writer
    file, then the empty directories. Returns the files it left (written by someone else); the
    directory stays if there are any."""
    if not (directory / WRITER).exists():
        write_writer(directory, files=files)  # a kill from here on leaves a directory the next run can judge
    ours = None if files is None else set(files) | {WRITER}
    left = []
    for relative in files_under(directory, exclude=(WRITER,)):
        if ours is None or relative in ours:
            (directory / relative).unlink()
        else:
            left.append(relative)
    if left:
        return left
    (directory / WRITER).unlink()
    for root, _, _ in sorted(os.walk(directory), key=lambda entry: -len(Path(entry[0]).parts)):
        os.rmdir(root)  # deepest first: every one is empty by now
    return []


def process_gone(pid: int, host: str, start: int | None = None) -> bool:
    """True if the process `pid` that started at `start` (None: unknown) is certainly not running: on this
    host, and absent, a zombie (killed, not reaped), or replaced by a process that started at another time."""
    if host != socket.gethostname():
        return False
    now = process_start(pid)
    if start is not None and now is not None and now != start:
        return True  # the pid now names another process (this one, even)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def clean_stale_siblings(parent: Path) -> None:
    """Removes the temp and aside trees in `parent` whose writing process is gone; warns about the
    ones it leaves (live or foreign writer, or files it did not write) and about what it removed."""
    try:
        entries = sorted(p for p in Path(parent).iterdir() if SIBLING.match(p.name))
    except OSError:
        return  # an unreadable parent is reported by the write that follows
    for path in entries:
        match = SIBLING.match(path.name)
        pid, host = int(match["pid"]), match["host"]
        if not process_gone(pid, host, None if match["start"] is None else int(match["start"])):
            warnings.warn(f"leaving {path}: a conversion by process {pid} on {host} that may still be running "
                          "(remove it yourself if it is not)", stacklevel=4)
            continue
        files = recorded_files(path)
        if files is False:
            warnings.warn(f"leaving {path}: left by a stopped conversion (process {pid}) but holding files it "
                          "did not record writing; remove it yourself", stacklevel=4)
            continue
        left = remove_tree(path, files=files)
        if left:
            warnings.warn(f"removed the files a stopped conversion (process {pid}) left in {path}, but not "
                          f"{left[:MAX_LISTED]} which it did not write", stacklevel=4)
        else:
            warnings.warn(f"removed {path}, left by a conversion (process {pid}) that was stopped before it "
                          "finished", stacklevel=4)


def recorded_files(path: Path):
    """What a stopped writer may delete in `path`: None for all (a temp tree), a list (an old tree,
    from the writer file or the manifest), or False when the tree records nothing (not ours)."""
    if not path.is_dir() or path.is_symlink():
        return False
    writer = path / WRITER
    try:
        files = json.loads(writer.read_text())["files"]
        return None if files is None else list(files)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, or cut short by the kill while it was being written: judge by what else is there
    if (path / MANIFEST).is_file():
        try:
            return [*read_manifest(path).files, MANIFEST]
        except ValueError:
            return False
    # nothing but empty directories (and a cut writer file): a writer killed while it removed the emptied
    # directories (remove_tree unlinks the writer file after the files, before the directories)
    return None if not files_under(path, exclude=(WRITER,)) else False
