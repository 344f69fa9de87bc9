"""Writing a checkpoint in a model's own HF format: config.json and the safetensors weights, one file or
shards named by model.safetensors.index.json, each file whole or not at all (`write_atomic`).

What `dllm_jax.checkpoint.hf` reads, written: the tiny checkpoints of the tests, the demo and the
notebooks (`dllm_jax.testing.write_hf_checkpoint` fills them with random weights) and the converter
benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import safetensors.numpy

from dllm_jax.files import write_atomic

INDEX_FILE = "model.safetensors.index.json"


def write_hf_files(directory, hf_config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1) -> Path:
    """Writes `hf_config` as config.json and `tensors` ({HF name: array}) as model.safetensors, or with
    shards > 1 as model-0000i-of-0000n.safetensors (names split in order) plus the index; returns
    `directory` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "config.json", json.dumps(hf_config, indent=2) + "\n")
    if shards == 1:
        write_atomic(directory / "model.safetensors", safetensors.numpy.save(tensors))
        return directory
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.array(list(tensors), dtype=object), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_atomic(directory / file, safetensors.numpy.save({n: tensors[n] for n in chunk}))
        weight_map |= {n: file for n in chunk}
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    write_atomic(directory / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return directory
