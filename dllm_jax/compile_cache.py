"""The persistent compilation cache: compiled programs kept on disk across processes, so that the second start of
a model with the same shapes (and options structure, flags, jax version and device) loads its programs instead
of compiling them. It is JAX's own cache (`jax_compilation_cache_dir`), keyed by the program; on a GPU XLA's
autotuning results are kept beside it.

On by default: `import dllm_jax` points JAX's cache at a folder of the user's own, unless a cache folder is set
already (`JAX_COMPILATION_CACHE_DIR`, or `jax.config.update("jax_compilation_cache_dir", ...)` before the import),
which is then left as it is. The folder is `$DLLM_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/dllm_jax/jax`, else
`~/.cache/dllm_jax/jax`, made readable by its owner only (a compiled program is code the process will run:
JAX's documentation asks that nobody else may write there). `DLLM_JAX_CACHE_DIR=off` turns the default off.
`configure(path | None, max_bytes=...)` sets it from Python; JAX reads the setting at the process's first
compilation, so call it before anything compiles.

Every program is kept, however fast it compiled (`MIN_COMPILE_SECONDS`; JAX's default keeps only those over 1 s,
and a second process would compile dozens of small ones again before its first result), unless
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says otherwise. The folder holds at most `max_bytes` (`$DLLM_JAX_CACHE_BYTES`, default 8 GiB): past it the least recently used
programs are dropped. JAX then guards every read and write with a file lock (the `filelock` package), so two
processes can use one folder at once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from dllm_jax import validation as check

VARIABLE = "DLLM_JAX_CACHE_DIR"
SIZE_VARIABLE = "DLLM_JAX_CACHE_BYTES"
DEFAULT_BYTES = 8 * 2**30
# programs that compile faster than this are not kept (JAX's default keeps only those over 1 s): 0 keeps the small
# host-side programs too, which a process otherwise compiles anew before its first result (dozens of them)
MIN_COMPILE_SECONDS = 0.0
MIN_COMPILE_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
OFF = ("off", "none", "0", "false", "no")


def default_folder(environ) -> Path | None:
    """The folder `environ` names for the cache (module docstring); None where it turns the cache off."""
    given = environ.get(VARIABLE)
    if given is not None:
        return None if given.strip().lower() in OFF or not given.strip() else Path(given).expanduser()
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dllm_jax" / "jax"


def size_limit(environ) -> int:
    """$DLLM_JAX_CACHE_BYTES as a positive number of bytes (DEFAULT_BYTES where unset); a ValueError naming it."""
    given = environ.get(SIZE_VARIABLE)
    if given is None:
        return DEFAULT_BYTES
    try:
        return check.integer(SIZE_VARIABLE, int(given), minimum=1)
    except ValueError:
        raise ValueError(f"{SIZE_VARIABLE}={given!r} must be a positive number of bytes") from None


def configure(folder: str | os.PathLike | None, *, max_bytes: int = DEFAULT_BYTES) -> Path | None:
    """Keeps compiled programs in `folder` (created, readable by its owner only), at most `max_bytes` of them, least
    recently used dropped first; None turns the cache off. Returns the folder. Takes effect only before the
    process's first compilation (JAX opens its cache then, once)."""
    if folder is None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    max_bytes = check.integer("max_bytes", max_bytes, minimum=1)
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ValueError(f"the compilation cache folder {folder} cannot be created: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the compilation cache folder {folder} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    if MIN_COMPILE_VARIABLE not in os.environ:  # JAX's own setting, where the user gives one, wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


def enable_default(environ=os.environ) -> Path | None:
    """The cache `import dllm_jax` sets up (module docstring): the folder in use, or None where a cache folder was
    set already, the environment turns it off, or it cannot be used (a warning says why: the import never
    fails over a cache)."""
    if jax.config.jax_compilation_cache_dir:
        return None
    try:
        folder = default_folder(environ)
        return None if folder is None else configure(folder, max_bytes=size_limit(environ))
    except ValueError as e:
        warnings.warn(f"dllm_jax: no persistent compilation cache ({e}); set {VARIABLE} to a writable folder, or to "
                      "'off'", stacklevel=2)
        return None
