"""Trained weights out as an HF checkpoint that `dllm_jax.load_model` (and the converter) read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dllm_jax.checkpoint.api import SIDE_FILES
from dllm_jax.checkpoint.hf import hf_name, invert_transform, rules_for, tree_get
from dllm_jax.checkpoint.hf_write import INDEX_FILE, write_hf_files
from dllm_jax.files import write_atomic
from dllm_jax.train.state import COMPUTE_DTYPES
from dllm_jax.train.surgery import check_param_shapes


def hf_tensors(params: dict, model, *, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{HF name: tensor} of float32 checkpoint-layout `params`: the inverse of the converter's name map
    and transforms (`dllm_jax.checkpoint.hf.invert_transform`)."""
    check_param_shapes(params, model)
    target = {"float32": np.float32, "bfloat16": jnp.bfloat16}[dtype]
    tensors = {}
    for rule in rules_for(model):
        stacked = np.asarray(tree_get(params, rule.path), np.float32)
        for layer in (range(model.num_layers) if rule.per_layer else [None]):
            value = invert_transform(rule.transform, stacked if layer is None else stacked[layer])
            tensors[hf_name(rule, layer)] = np.ascontiguousarray(value).astype(target)
    return tensors


def export_hf(params: dict, model_config, directory, tokenizer_dir=None, *, dtype: str = "float32") -> Path:
    """Writes `params` (checkpoint layout) as an HF checkpoint: config.json + model.safetensors in the
    family's own names (what `dllm_jax.load_model` and the converter read), stored as `dtype`
    ("float32" | "bfloat16"), plus the tokenizer files of `tokenizer_dir` (tokenizer.json, ...).

    Each file is replaced atomically. A `model.safetensors.index.json` already in `directory` (an earlier
    sharded checkpoint) is removed with the shard files it names: the loader would read those instead of
    the new weights."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"export dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    side = {}
    if tokenizer_dir is not None:
        side = {name: (Path(tokenizer_dir) / name).read_bytes() for name in SIDE_FILES
                if (Path(tokenizer_dir) / name).is_file()}
        if "tokenizer.json" not in side:
            raise ValueError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json")
    tensors = hf_tensors(params, model_config, dtype=dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_index(directory)
    write_hf_files(directory, model_config.to_hf_config() | {"torch_dtype": dtype}, tensors)
    for name, content in side.items():
        write_atomic(directory / name, content)
    return directory


def remove_stale_index(directory: Path) -> None:
    """Removes `directory`'s safetensors index and the shard files it names inside `directory` (the index
    first: a kill in between leaves shards the loader reports as doubly stored, never read silently)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = {str(v) for v in weight_map.values()} if isinstance(weight_map, dict) else set()
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        shards = set()
    index.unlink()
    for name in sorted(shards):
        shard = directory / name
        if Path(name).name == name and name.endswith(".safetensors") and name != "model.safetensors" \
                and shard.is_file():
            shard.unlink()
    print(f"export: removed the stale {index} and its {len(shards)} shard files", file=sys.stderr)
