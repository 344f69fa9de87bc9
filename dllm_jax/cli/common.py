"""What several subcommands share: the --dtype, --quantize and --mesh flags, and the checks and writes of output paths.

Output paths are checked before a run (which may take minutes) and nothing is created by a check: a refused
run leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def dtype_parent() -> argparse.ArgumentParser:
    """The parent parser of --dtype (generate, analyze, eval, bench, demo)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and compute dtype (default bfloat16)")
    return parent


def add_quantize_flag(parser: argparse.ArgumentParser) -> None:
    """--quantize of the subcommands that load a checkpoint (load_model's quantize)."""
    parser.add_argument("--quantize", default=None, choices=["int8", "fp8"],
                        help="quantize the linear layers' weights at load (a scale per output channel; fp8 needs a "
                             "GPU with FP8 tensor cores); a tree converted with --quantize loads as its mode "
                             "without it")


def add_mesh_flag(parser: argparse.ArgumentParser, split: str) -> None:
    """--mesh of generate and eval; `split` names what dp splits (the prompts, the samples)."""
    parser.add_argument("--mesh", type=mesh_spec, default=None, metavar="tp=N[,sp=S][,dp=M]",
                        help=f"shard the model over N devices (tensor parallelism) and the {split} over M")


def mesh_spec(text: str) -> dict[str, int]:
    """--mesh tp=2,dp=2 -> {"dp": 2, "tp": 2} (dllm_jax.sharding.parse_mesh), an argparse error otherwise."""
    from dllm_jax.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mesh_of(args):
    """The jax Mesh of --mesh (over this machine's devices), or None."""
    from dllm_jax.sharding import make_mesh

    return None if args.mesh is None else make_mesh(args.mesh)


def checked_out_dir(path: Path) -> Path:
    """`path` if it is a directory that exists or can be created, and can be written into (not created here:
    a failed run leaves nothing behind)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is an existing file, not a directory")
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"--out {path} cannot be created: {nearest} is a file")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path} is not writable: no write permission in {nearest}")
    return path


def checked_out_file(path: Path, flag: str) -> Path:
    """`path` if a file can be written there: missing or a regular file (a symbolic link: its target, as
    `dllm_jax.files.write_atomic` writes it), in a directory that exists or can be created and can be written into
    (nothing is created here: a refused run leaves nothing behind)."""
    from dllm_jax.files import replaceable

    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: name the file to write")
    nearest = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"{flag} {path} cannot be written: {nearest} is a file, not a directory")
    try:
        target = replaceable(path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if target != path:
        return checked_out_file(target, flag)
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable: no write permission in {nearest}")
    return path


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Writes {name: content} into `directory` (created), each file whole or not at all
    (`dllm_jax.files.write_atomic`: a temporary name and a rename), so no reader ever sees half of one."""
    from dllm_jax.files import write_atomic

    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        write_atomic(directory / name, content)
