"""The commit manifest of a converted checkpoint.

`dllm_jax_manifest.json` is the last file a conversion writes (after every other file is flushed to
disk), so its presence means the tree is complete. It records what the loader needs to trust the
tree and what `overwrite=True` may delete:

  format_version  the converted layout (2: this manifest; 1, before it, had none; 3: a quantized tree, which
                  versions before quantization refuse by name instead of misreading it)
  param_dtype     the dtype the parameters are stored in (a quantized tree: its unquantized ones)
  quantize        (format 3 only) "int8" or "fp8": the linear layers' weights are stored in that dtype, each
                  with a float32 `<name>_scale` per output channel (`dllm_jax.quantize`)
  files           every file the conversion wrote (relative POSIX paths, the manifest excluded)
  chunk_bytes     the checksum unit
  checksums       {tree path: [CRC-32 of each chunk_bytes piece of the stored bytes, C order]} for
                  every parameter tensor
  file_checksums  {file: CRC-32 of its bytes as written} for config.json and the side files copied
                  from the source (tokenizer, generation defaults, chat template): a changed
                  rope_theta would change every output as surely as a changed weight. Trees written
                  before this field have none, and nothing is checked for them (same format_version:
                  an older dllm_jax reading a newer tree ignores the field)

CRC-32 guards against accidental damage (a flipped or truncated block, a bad copy), not against a
deliberate forgery: it is the fastest checksum of the standard library (about 2 GB/s on one core,
and zlib releases the GIL, so the 64 MiB pieces of a tensor are checksummed on all cores at once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dllm_jax.checkpoint.orbax import tree_paths
from dllm_jax.files import fsync_path, write_atomic
from dllm_jax.quantize import MODES as QUANTIZE_MODES

MANIFEST = "dllm_jax_manifest.json"
FORMAT_VERSION = 2
QUANTIZED_FORMAT_VERSION = 3
KNOWN_FORMAT_VERSIONS = (2, 3)
PARAM_DTYPES = ("bfloat16", "float32")
CHUNK_BYTES = 1 << 26


@dataclasses.dataclass(frozen=True)
class Manifest:
    format_version: int
    param_dtype: str
    files: tuple[str, ...]
    checksums: dict[str, list[int]]
    chunk_bytes: int = CHUNK_BYTES
    file_checksums: dict[str, int] = dataclasses.field(default_factory=dict)
    quantize: str | None = None

    def to_json(self) -> str:
        quantized = {"quantize": self.quantize} if self.quantize else {}
        return json.dumps(dict(format_version=self.format_version, param_dtype=self.param_dtype, **quantized,
                               checksum="crc32", chunk_bytes=self.chunk_bytes, files=list(self.files),
                               checksums=self.checksums, file_checksums=self.file_checksums), indent=1) + "\n"


def tensor_checksum(array, *, chunk_bytes: int = CHUNK_BYTES, pool: ThreadPoolExecutor | None = None) -> list[int]:
    """CRC-32 of each `chunk_bytes` piece of the array's bytes in C order (a host copy for a device
    array: one tensor on the host at a time), computed on `pool`'s threads if given."""
    data = np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)
    pieces = [data[start:start + chunk_bytes] for start in range(0, max(data.size, 1), chunk_bytes)]
    return list(pool.map(zlib.crc32, pieces) if pool is not None else map(zlib.crc32, pieces))


def tree_checksums(tree, *, chunk_bytes: int = CHUNK_BYTES, cast=None) -> dict[str, list[int]]:
    """{tree path: tensor_checksum} of every leaf, leaf after leaf, each cast to `cast` first if given."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return {path: tensor_checksum(leaf if cast is None else np.asarray(leaf).astype(cast, copy=False),
                                      chunk_bytes=chunk_bytes, pool=pool)
                for path, leaf in tree_paths(tree).items()}


def files_under(directory: Path, *, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every file (and symlink) below `directory`, as sorted relative POSIX paths."""
    directory = Path(directory)
    found = []
    for root, dirs, files in os.walk(directory):
        links = [d for d in dirs if (Path(root) / d).is_symlink()]  # os.walk lists them as dirs
        for name in files + links:
            relative = (Path(root) / name).relative_to(directory).as_posix()
            if relative not in exclude:
                found.append(relative)
    return tuple(sorted(found))


def sync_tree(directory: Path) -> None:
    """fsyncs every file and directory below `directory`, so that a manifest written after this
    call can never be on disk before the data it vouches for (a power loss, not only a kill)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def file_checksum(path: Path) -> int:
    """CRC-32 of a small file's bytes (config.json, a tokenizer file)."""
    return zlib.crc32(Path(path).read_bytes())


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Writes the manifest atomically (temp file, fsync, rename): the commit point of a conversion."""
    write_atomic(Path(directory) / MANIFEST, manifest.to_json())


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a converted tree; ValueError if it is absent (an interrupted conversion),
    unreadable, or names a format version or parameter dtype this version does not know."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"converted checkpoint {directory} is not committed (no {MANIFEST}): an interrupted "
                         f"conversion, or one written by an older dllm_jax; convert the HF checkpoint again")
    try:
        raw = json.loads(path.read_text())
        manifest = Manifest(format_version=raw["format_version"], param_dtype=raw["param_dtype"],
                            files=tuple(raw["files"]), chunk_bytes=int(raw["chunk_bytes"]),
                            checksums={str(k): [int(c) for c in v] for k, v in raw["checksums"].items()},
                            file_checksums={str(k): int(v) for k, v in raw.get("file_checksums", {}).items()},
                            quantize=raw.get("quantize"))
        stray = sorted(set(manifest.file_checksums) - set(manifest.files))
        if stray:  # a checksum vouches only for a file the conversion recorded writing
            raise ValueError(f"file_checksums names files the conversion did not write: {stray}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}); convert the HF checkpoint again") from e
    check_versions(path, manifest.format_version, manifest.param_dtype, manifest.quantize)
    return manifest


def check_versions(where, format_version, param_dtype, quantize=None) -> None:
    """ValueError unless `format_version`, `param_dtype` and `quantize` are ones this version reads, and a
    quantized tree (and only one) has the quantized format version."""
    if format_version not in KNOWN_FORMAT_VERSIONS or isinstance(format_version, bool):
        raise ValueError(f"{where}: format_version {format_version!r} is not one this version of dllm_jax reads "
                         f"({list(KNOWN_FORMAT_VERSIONS)}); convert the HF checkpoint again with this version")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"{where}: param_dtype {param_dtype!r} is not one of {list(PARAM_DTYPES)}; convert the "
                         f"HF checkpoint again")
    quantized = format_version == QUANTIZED_FORMAT_VERSION
    if quantized != (quantize is not None) or quantize not in (None, *QUANTIZE_MODES):
        raise ValueError(f"{where}: format_version {format_version} with quantize {quantize!r} is not a tree this "
                         f"version wrote (quantized trees are format {QUANTIZED_FORMAT_VERSION} with quantize one of "
                         f"{list(QUANTIZE_MODES)}); convert the HF checkpoint again")
