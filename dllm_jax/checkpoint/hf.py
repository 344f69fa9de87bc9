"""Hugging Face safetensors -> parameter tree: name maps, validation, streaming conversion.

The name map is data (`dllm_jax.models.hf_names`, one per family): each rule maps an HF tensor name
(regex; group 1 is the layer index for per-layer weights) to a path in the parameter tree and a
layout transform. Every tensor of the
checkpoint is checked by name, shape and dtype from the file headers alone before any data is read,
and all problems are reported together in one ValueError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from dllm_jax.families import family_of
from dllm_jax.models.hf_names import Rule, tree_get

FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
TARGET_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
MAX_LISTED_PROBLEMS = 40


def hf_name(rule: Rule, layer: int | None) -> str:
    """The concrete HF tensor name a rule expects (for layer `layer` if per-layer)."""
    name = rule.pattern.replace(r"(\d+)", str(layer)) if rule.per_layer else rule.pattern
    return name.replace("\\.", ".")


def hf_shape(transform: str, target: tuple[int, ...]) -> tuple[int, ...]:
    """The HF (torch) shape that becomes `target` (one layer's shape) under `transform`."""
    if transform == "copy":
        return target
    if transform == "transpose":
        return target[::-1]
    if transform == "heads_in":  # target [d, H, D] <- [H*D, d]
        return (target[1] * target[2], target[0])
    if transform == "heads_out":  # target [H, D, d] <- [d, H*D]
        return (target[2], target[0] * target[1])
    if transform == "heads_bias":  # target [H, D] <- [H*D]
        return (target[0] * target[1],)
    raise ValueError(f"unknown transform {transform!r}")


def apply_transform(transform: str, array: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
    """The HF tensor in the tree's layout: every transform but "copy" is a transpose, then the
    head split of `target` (a no-op reshape for plain transposes)."""
    return array if transform == "copy" else array.T.reshape(target)


def invert_transform(transform: str, array: np.ndarray) -> np.ndarray:
    """The HF tensor of one layer's tree-layout `array`: the inverse of `apply_transform` (the head
    split merged back, then the transpose undone)."""
    return array if transform == "copy" else array.reshape(hf_shape(transform, array.shape)[::-1]).T


def rules_for(config) -> tuple[Rule, ...]:
    """The name map of config's family; a tied head has no LM-head tensor."""
    rules = family_of(config).hf_rules
    return tuple(r for r in rules if not (config.tie_word_embeddings and r.path == ("lm_head",)))


def param_shapes_for(config) -> dict:
    """The checkpoint-layout parameter shapes of config's family."""
    return family_of(config).param_shapes(config)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    entry: TensorEntry
    rule: Rule
    layer: int | None
    target: tuple[int, ...]  # shape of this tensor in the tree (one layer's slice if per-layer)


def safetensors_files(hf_dir: Path) -> dict[str, Path] | list[Path]:
    """The weight map {name: file} of a sharded checkpoint, or the list of single files.

    Every shard is read from inside hf_dir: the index must name each file by a relative path
    without `..` (checked on the name as written, not where a link leads, so a Hugging Face cache
    snapshot, whose files link into the repository's blobs/, still reads). Every shard must be a
    regular file once links are followed: a FIFO or a device named *.safetensors would block the
    reader forever. ValueError naming the index or the file otherwise.
    """
    index = hf_dir / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        check_regular({index: file_problem(index)})
        files = {name: hf_dir / file for name, file in index_weight_map(index).items()}
        unreadable = {file: file_problem(file) for file in set(files.values())}
        absent = sorted(f.name for f, problem in unreadable.items() if problem == "does not exist")
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {absent}")
        check_regular(unreadable)
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files (and no model.safetensors.index.json) in {hf_dir}")
    check_regular({file: file_problem(file) for file in files})
    return files


def index_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index, {tensor name: shard file}, each shard named by a
    relative path inside the index's folder; ValueError naming the index and the bad entry."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: JSON or UTF-8
        raise ValueError(f"{index} is not a valid safetensors index (needs 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} is not a valid safetensors index: 'weight_map' must be an object "
                         f"{{tensor name: shard file}}, got {type(weight_map).__name__} {str(weight_map)[:80]}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"{index} is not a valid safetensors index: weight_map entry {name!r} must name a "
                             f"shard file (a string), got {file!r}")
        parts = PurePosixPath(file).parts
        if not parts or PurePosixPath(file).is_absolute() or ".." in parts or "\0" in file:
            raise ValueError(f"{index}: weight_map entry {name!r} names the shard {file!r}, which is not a relative "
                             f"path inside {index.parent} (absolute paths and '..' are refused)")
    return weight_map


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a data file, or None if it is a regular file (links followed)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"is a broken symbolic link (to {os.readlink(path)})" if path.is_symlink() else "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def check_regular(problems: dict[Path, str | None]) -> None:
    """ValueError naming every file of {file: file_problem(file)} that is not a readable regular file."""
    bad = sorted((str(file), problem) for file, problem in problems.items() if problem)
    if bad:
        listed = "; ".join(f"{file} {problem}" for file, problem in bad[:MAX_LISTED_PROBLEMS])
        raise ValueError(f"{listed}: only regular files are read")


def read_headers(hf_dir: Path) -> list[TensorEntry]:
    """Every tensor's name, file, shape and dtype, read from the safetensors headers only."""
    found = safetensors_files(hf_dir)
    files = sorted(set(found.values())) if isinstance(found, dict) else found
    entries, problems, seen, broken = [], [], {}, set()
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    entries.append(TensorEntry(name, file, tuple(s.get_shape()), s.get_dtype()))
        except SafetensorError as e:
            broken.add(file)
            problems.append(f"{file.name}: corrupt or truncated safetensors file ({e})")
    for e in entries:
        if e.name in seen:
            problems.append(f"{e.name}: stored twice ({seen[e.name].name} and {e.file.name})")
        seen[e.name] = e.file
    if isinstance(found, dict):
        for name, file in found.items():
            if file in broken:
                continue
            if name not in seen:
                problems.append(f"{name}: listed in the index but not in {file.name}")
            elif seen[name] != file:
                problems.append(f"{name}: index says {file.name} but it is in {seen[name].name}")
    if problems:
        raise_problems(hf_dir, problems)
    return entries


def plan_conversion(hf_dir: str | Path, config) -> list[PlannedTensor]:
    """Matches every tensor of the checkpoint to the parameter tree of `config`.

    Raises one ValueError listing every missing, unexpected, mis-shaped or non-float tensor (the family's
    `hf_skipped` names excepted: tensors the model does not read).
    """
    hf_dir = Path(hf_dir)
    entries = read_headers(hf_dir)
    rules = rules_for(config)
    shapes = param_shapes_for(config)
    family = family_of(config)
    expand = family.hf_expected  # a family whose tensors are not one per rule and layer
    expected = expand(config, shapes) if expand else {}
    skipped = re.compile("|".join(f"(?:{pattern})" for pattern in family.hf_skipped)) if family.hf_skipped else None
    for rule in () if expand else rules:
        layers = range(config.num_layers) if rule.per_layer else [None]
        for layer in layers:
            target = tree_get(shapes, rule.path)
            target = target[1:] if rule.per_layer else target
            expected[hf_name(rule, layer)] = (rule, layer, target)
    problems, plan = [], []
    for e in entries:
        if e.name not in expected and skipped is not None and skipped.fullmatch(e.name):
            continue  # held by the checkpoint, not read by the model (Family.hf_skipped)
        if e.name not in expected:
            problems.append(f"{e.name}: unexpected tensor {list(e.shape)} (not part of this model's config)")
            continue
        rule, layer, target = expected.pop(e.name)
        want = hf_shape(rule.transform, target)
        if e.shape != want:
            problems.append(f"{e.name}: shape {list(e.shape)}, config expects {list(want)}")
        elif e.dtype not in FLOAT_DTYPES:
            problems.append(f"{e.name}: dtype {e.dtype}, expected one of {sorted(FLOAT_DTYPES)}")
        else:
            plan.append(PlannedTensor(e, rule, layer, target))
    problems += [f"{name}: missing" for name in expected]
    if problems:
        raise_problems(hf_dir, problems)
    return plan


def raise_problems(hf_dir: Path, problems: list[str]):
    shown = problems[:MAX_LISTED_PROBLEMS]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more" if more else ""
    raise ValueError(f"checkpoint {hf_dir} does not match its config ({len(problems)} problems):\n  "
                     + "\n  ".join(shown) + tail)


def empty_tree(shapes: dict, dtype) -> dict:
    return {k: empty_tree(v, dtype) if isinstance(v, dict) else np.empty(v, dtype) for k, v in shapes.items()}


def read_hf_params(hf_dir: str | Path, config, *, dtype: str = "bfloat16", progress: bool = True) -> dict:
    """Reads and converts a validated HF checkpoint into a tree of numpy arrays of `dtype`.

    Streams tensor by tensor into preallocated arrays: peak host memory is the converted model
    plus one tensor, never two copies of the model. Raises ValueError naming every tensor that
    holds NaN or Inf (after the cast to `dtype`).
    """
    if dtype not in TARGET_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TARGET_DTYPES)}, got {dtype!r}")
    plan = plan_conversion(hf_dir, config)
    params = empty_tree(param_shapes_for(config), TARGET_DTYPES[dtype])
    by_file: dict[Path, list[PlannedTensor]] = {}
    for item in plan:
        by_file.setdefault(item.entry.file, []).append(item)
    bar = tqdm(total=len(plan), desc="converting tensors", unit="tensor", disable=not progress)
    nonfinite = []
    for file, items in by_file.items():
        try:
            with safe_open(file, framework="np") as f:
                for item in items:
                    array = apply_transform(item.rule.transform, f.get_tensor(item.entry.name), item.target)
                    dest = tree_get(params, item.rule.path)
                    dest = dest if item.layer is None else dest[item.layer]
                    dest[...] = array
                    if not np.isfinite(dest).all():  # the stored values: a cast can overflow to Inf
                        nonfinite.append(f"{item.entry.name}: {int(np.isnan(dest).sum())} NaN, "
                                         f"{int(np.isinf(dest).sum())} Inf")
                    bar.update()
        except SafetensorError as e:
            raise ValueError(f"{file}: could not read tensor data ({e})") from e
    bar.close()
    if nonfinite:
        raise ValueError(f"checkpoint {hf_dir} holds non-finite weights (NaN or Inf, as {dtype}) in "
                         f"{len(nonfinite)} tensors; they would make every output NaN:\n  "
                         + "\n  ".join(nonfinite[:MAX_LISTED_PROBLEMS]))
    return params


def source_dtype(plan: list[PlannedTensor]) -> str:
    """The stored dtype that holds every tensor of `plan` exactly: bfloat16 if all are BF16, else
    float32 (F32, F16 and mixes fit float32 without rounding; F16 does not fit bfloat16)."""
    return "bfloat16" if all(item.entry.dtype == "BF16" for item in plan) else "float32"
