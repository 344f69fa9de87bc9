"""The checkpoint contract: `convert_hf_checkpoint` and `load_model`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dllm_jax.checkpoint import orbax as orbax_io
from dllm_jax.checkpoint.hf import TARGET_DTYPES, param_shapes_for, plan_conversion, read_hf_params
from dllm_jax.config import LLaDAConfig, SDARConfig, read_hf_config
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.sdar import SDAR

MODEL_CLASSES = {LLaDAConfig: LLaDA, SDARConfig: SDAR}

FORMAT_VERSION = 1
# Files of an HF checkpoint directory that travel with a conversion (tokenizer, generation defaults).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja")


def convert_hf_checkpoint(hf_dir, out_dir, *, dtype: str = "bfloat16", overwrite: bool = False,
                          progress: bool = True) -> None:
    """Converts an HF safetensors checkpoint (single file or sharded with an index) to Orbax.

    Every tensor is validated (name, shape, dtype) before anything is written. The result is
    built in a temporary sibling directory and renamed into place, so `out_dir` never holds a
    partial conversion; on any error it is left as it was (absent, or untouched).

    Args:
      hf_dir: directory with config.json and *.safetensors.
      out_dir: directory to create (must not exist unless overwrite=True).
      dtype: stored parameter dtype, "bfloat16" or "float32".
      overwrite: replace an existing out_dir.
      progress: show a tqdm bar over the tensors.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype not in TARGET_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TARGET_DTYPES)}, got {dtype!r}")
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists (pass overwrite=True, or --overwrite, to replace it)")
    raw, config = read_hf_config(hf_dir)
    plan_conversion(hf_dir, config)  # fail on a bad checkpoint before creating anything
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        params = read_hf_params(hf_dir, config, dtype=dtype, progress=progress)
        orbax_io.save_params(tmp, params)
        del params
        raw = dict(raw, dllm_jax={"format_version": FORMAT_VERSION, "param_dtype": dtype})
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for name in SIDE_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_converted(path: Path) -> bool:
    return (path / orbax_io.PARAMS_DIR).is_dir() and (path / "config.json").is_file()


def load_model(path, *, dtype=None, progress: bool = True):
    """Loads a model from a converted Orbax directory or directly from an HF directory.

    Args:
      path: a directory written by `convert_hf_checkpoint`, or an HF checkpoint directory
        (config.json + *.safetensors, converted in memory).
      dtype: parameter and compute dtype, "bfloat16" (the default when None) or "float32".
      progress: show a tqdm bar while converting an HF directory in memory.
    Returns:
      The NNX model (`LLaDA` or `SDAR`, from config.json); `model(input_ids) -> float32 logits
      [B, L, V]` (bidirectional for LLaDA, block-causal for SDAR); `model.config`.
    """
    path = Path(path)
    dtype = "bfloat16" if dtype is None else jnp.dtype(dtype).name
    if dtype not in TARGET_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TARGET_DTYPES)}, got {dtype!r}")
    if not path.exists():
        raise ValueError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (load_model takes a checkpoint directory)")
    _, config = read_hf_config(path)
    if is_converted(path):
        params = orbax_io.restore_params(path, param_shapes_for(config), jnp.dtype(dtype))
    elif any(path.glob("*.safetensors")):
        params = to_device_leafwise(read_hf_params(path, config, dtype=dtype, progress=progress))
    else:
        raise ValueError(f"{path} holds neither a converted checkpoint (params/) nor *.safetensors")
    return model_from_params(config, params)


def to_device_leafwise(tree: dict) -> dict:
    """Moves a nested dict of host arrays to the default device in place, one leaf at a time,
    dropping each host copy as it goes (peak: the model once plus one tensor)."""
    for key, value in tree.items():
        tree[key] = to_device_leafwise(value) if isinstance(value, dict) else jax.device_put(value)
    return tree


def model_from_params(config, params: dict):
    """Builds the model of `config` around an existing parameter tree (no random init)."""
    model_class = MODEL_CLASSES.get(type(config))
    if model_class is None:
        raise ValueError(f"unsupported config type {type(config).__name__}")
    dtype = params["embed"].dtype
    abstract = nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
