"""Orbax storage of parameter trees (the converted-checkpoint format).

A converted directory holds `config.json` (the model's HF config plus a `dllm_jax` entry),
`params/` (an Orbax StandardCheckpointer tree with the layout of `<model>.param_shapes`), the side
files of the source (tokenizer...) and, written last, `dllm_jax_manifest.json` (see `manifest`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

PARAMS_DIR = "params"


def tree_paths(tree, *, is_leaf=None) -> dict:
    """{"layers/q_proj": leaf} of a nested dict: the names of stored tensors (shape checks, checksums)."""
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def is_shape(x) -> bool:
    """Leaves of a shape tree (`<model>.param_shapes`) are tuples."""
    return isinstance(x, tuple)


def save_params(directory: Path, params: dict) -> None:
    """Writes the tree under `directory/params` and waits until it is committed."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(directory).absolute() / PARAMS_DIR, params)


def stored_shapes(directory: Path) -> dict:
    """{path: (shape, dtype)} of the stored tree, read from Orbax metadata without the data."""
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(Path(directory).absolute() / PARAMS_DIR).item_metadata.tree
    except Exception as e:  # Orbax reports missing metadata as AttributeError, OSError, ValueError...
        raise damaged(directory, e) from e
    if tree is None:
        raise damaged(directory, "no tree metadata")
    return {path: (tuple(m.shape), np.dtype(m.dtype)) for path, m in tree_paths(tree).items()}


def restore_params(directory: Path, shapes: dict, dtype) -> dict:
    """Restores the tree of `shapes` onto the default device, cast to `dtype` (one dtype, or a tree of them
    shaped like `shapes`: a quantized tree's per-tensor dtypes).

    Raises ValueError naming every stored tensor whose path or shape differs from `shapes`.
    """
    directory = Path(directory).absolute()
    expected = {path: tuple(shape) for path, shape in tree_paths(shapes, is_leaf=is_shape).items()}
    stored = stored_shapes(directory)
    problems = [f"{p}: missing" for p in expected if p not in stored]
    problems += [f"{p}: unexpected" for p in stored if p not in expected]
    problems += [f"{p}: stored shape {list(stored[p][0])}, config expects {list(s)}"
                 for p, s in expected.items() if p in stored and stored[p][0] != s]
    if problems:
        raise ValueError(f"converted checkpoint {directory} does not match its config.json:\n  "
                         + "\n  ".join(problems) + "\n(a tree written by another version of dllm_jax, e.g. a quantized "
                         "LLaDA2 tree from before its routed experts were quantized: convert the HF checkpoint again)")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtypes = dtype if isinstance(dtype, dict) else jax.tree.map(lambda _: dtype, shapes, is_leaf=is_shape)
    target = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sharding), shapes, dtypes, is_leaf=is_shape)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(directory / PARAMS_DIR, target)
    except Exception as e:  # a missing data file surfaces as a bare TensorStore Exception
        raise damaged(directory, e) from e


def damaged(directory: Path, cause) -> ValueError:
    cause = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if isinstance(cause, Exception) else cause
    return ValueError(f"{Path(directory) / PARAMS_DIR} is not a complete Orbax checkpoint (files missing or "
                      f"damaged; convert the HF checkpoint again): {cause}")
