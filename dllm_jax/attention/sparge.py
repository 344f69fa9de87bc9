"""SpargeAttn (arXiv 2502.18137; official code thu-ml/SpargeAttn, docs/methods.md §4) as an attention
policy for LLaDA.

The policy predicts a fresh block map at every sparse step (SpargeAttn has no reuse across calls) and
runs `pallas_kernels.sparge_attention` with it; optionally the first int(T * skip) steps are dense, as
SparseD's early steps. Hyperparameters (simthreshd1, cdfthreshd | topk, pvthreshd) are scalars, one
value per query head, or one row per layer from `dllm_jax.analysis.calibration.calibrate_llada`;
they ride in the per-layer policy state, so per-layer values need no recompilation.

SDAR block steps are out of scope: a step has block_size (4) queries against the cache, less than one
64-row query tile, which is the case the official code rejects too (decode: thu-ml/SpargeAttn issue #59); MAGE and
FlashBlock cover SDAR.

Calibration (per-head values for `from_calibration`, a tool that runs the model) lives in
`dllm_jax.analysis.calibration`; this module keeps the policy and reads the file it writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from dllm_jax import validation
from dllm_jax.attention import kernels
from dllm_jax.attention.policy import (AttentionPolicy, Mode, check_backend, check_field, check_power_of_two,
                                     field_label)

DENSE_HEAD = dict(simthreshd1=1.0, cdfthreshd=1.0, pvthreshd=50.0)  # the official autotune's "not sparse"


def _values(name: str, value, num_layers: int | None, num_heads: int) -> np.ndarray | None:
    """A hyperparameter as float32 [L, Hq] (None stays None): scalar, [Hq] or [L, Hq]."""
    if value is None:
        return None
    arr = np.asarray(value, np.float32)
    if arr.ndim == 2:
        if num_layers is not None and arr.shape[0] != num_layers:
            raise ValueError(f"SpargeAttn {name} has {arr.shape[0]} layers of values, the model has {num_layers}")
        if arr.shape[1] != num_heads:
            raise ValueError(f"SpargeAttn {name} has {arr.shape[1]} values per layer, the model has {num_heads} "
                             "query heads")
        return arr
    if arr.ndim == 1 and arr.shape[0] != num_heads:
        raise ValueError(f"SpargeAttn {name} has {arr.shape[0]} values, the model has {num_heads} query heads")
    if arr.ndim > 2:
        raise ValueError(f"SpargeAttn {name} must be a scalar, [heads] or [layers, heads], got shape {arr.shape}")
    return np.broadcast_to(arr, (num_layers or 1, num_heads))


def _hashable(arr: np.ndarray):
    """An array as nested tuples of floats: the policy is a static (hashed) argument of the loop."""
    return float(arr) if arr.ndim == 0 else tuple(map(_hashable, arr))


def hyperparameter(name: str, value, *, low, high):
    """A scalar, [heads] or [layers, heads] of finite reals in [low, high], as a float or nested tuples."""
    return _hashable(validation.real_array(name, value, low=low, high=high, max_ndim=2))


def check_head_shapes(policy: "SpargeAttn") -> None:
    """The per-head values must agree on the number of heads, and the per-layer ones on the layers."""
    shapes = {name: np.shape(getattr(policy, name)) for name in ("simthreshd1", "cdfthreshd", "topk", "pvthreshd")
              if np.ndim(getattr(policy, name)) > 0}
    for axis, what in ((-1, "heads"), (-2, "layers")):
        sizes = {name: shape[axis] for name, shape in shapes.items() if len(shape) >= -axis}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"SpargeAttn's per-head values disagree on the number of {what}: "
                             + ", ".join(f"{name} has shape {list(shapes[name])}" for name in sizes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpargeAttn(AttentionPolicy):
    """SpargeAttn's configuration.

    simthreshd1: self-similarity threshold; blocks at or below it are "fix blocks", always computed.
    cdfthreshd / topk: exactly one (default: topk 0.5, the official recommended entry point); TopCdf
      keeps the most probable pooled blocks whose cumulative probability stays <= cdfthreshd, topk
      keeps floor(topk * key blocks); at least one block per row either way.
    pvthreshd: the PV-skip threshold in base-2 logits (50, the official default, practically never
      skips; None compiles the kernel without the filter).
    Each of the four: a scalar, one value per query head, or [layers][heads] (see `from_calibration`).
    smooth_k, block_q, block_kv, attention_sink: as `pallas_kernels.sparge_attention` (64 x 128 tiles).
    skip: fraction of the total steps run dense first (0: sparse from step 0).
    backend: as SparseD's (`backends.METHOD_BACKENDS`; "auto": Pallas on GPU, references elsewhere).
    """

    simthreshd1: float | tuple = -0.1
    cdfthreshd: float | tuple | None = None
    topk: float | tuple | None = None
    pvthreshd: float | tuple | None = 50.0
    smooth_k: bool = True
    block_q: int = 64
    block_kv: int = 128
    attention_sink: bool = False
    skip: float = 0.0
    backend: str = "auto"
    total_steps: int | None = None

    def __post_init__(self):
        if self.cdfthreshd is not None and self.topk is not None:
            raise ValueError("SpargeAttn takes cdfthreshd or topk, not both")
        if self.cdfthreshd is None and self.topk is None:
            object.__setattr__(self, "topk", 0.5)
        for name, low, high in (("simthreshd1", None, None), ("cdfthreshd", 0, 1), ("topk", 0, 1),
                                ("pvthreshd", None, None)):
            if getattr(self, name) is not None:
                check_field(self, name, hyperparameter, low=low, high=high)
        check_head_shapes(self)
        check_power_of_two(self, "block_q")
        check_power_of_two(self, "block_kv")
        check_field(self, "smooth_k", validation.flag)
        check_field(self, "attention_sink", validation.flag)
        check_field(self, "skip", validation.real)
        if not 0.0 <= self.skip < 1.0:
            raise ValueError(f"{field_label(self, 'skip')}={self.skip} must lie in [0, 1)")
        check_backend(self)
        check_field(self, "total_steps", validation.integer, optional=True)

    @classmethod
    def from_calibration(cls, path, **overrides) -> "SpargeAttn":
        """The policy with the per-layer, per-head values that `dllm_jax.analysis.calibration.save_calibration`
        wrote (a JSON file); `overrides` replace fields after the file's values are checked.

        Every problem with the file is a ValueError naming it and the key."""
        data = load_calibration(path)
        fields = {name: data[name] for name in CALIBRATED}
        fields |= {name: data[name] for name in CALIBRATION_SETTINGS if name in data}
        try:
            policy = cls(**fields)
        except ValueError as e:
            raise ValueError(f"calibration file {path}: {e}") from e
        return dataclasses.replace(policy, **overrides) if overrides else policy

    def bind(self, *, total_steps: int, **_):
        return dataclasses.replace(self, total_steps=total_steps)

    @property
    def selection_param(self) -> str:
        """The block-selection hyperparameter in use ("cdfthreshd" or "topk"); not the base class's
        `selection(state)` hook, which SpargeAttn leaves at None (its map is rebuilt every call)."""
        return "cdfthreshd" if self.cdfthreshd is not None else "topk"

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        """The hyperparameters of one layer, f32 [Hq] each (per-layer values come in `stack_layers`)."""
        if head_dim not in (16, 32, 64, 128, 256):
            raise ValueError(f"SpargeAttn needs a power-of-two head_dim, got {head_dim}")
        return {name: jnp.asarray(_values(name, getattr(self, name), None, num_heads)[0])
                for name in ("simthreshd1", self.selection_param, "pvthreshd") if getattr(self, name) is not None}

    def stack_layers(self, states):
        num_layers = states["simthreshd1"].shape[0]
        return {name: jnp.asarray(_values(name, getattr(self, name), num_layers, stacked.shape[1]))
                if np.ndim(getattr(self, name)) == 2 else stacked for name, stacked in states.items()}

    def state_partition(self):
        return {name: P("tp") for name in ("simthreshd1", self.selection_param, "pvthreshd")
                if getattr(self, name) is not None}  # per query head, as init_state

    @property
    def query_block(self) -> int:
        return self.block_q

    def mode(self, step):
        dense_steps = 0 if self.skip == 0 else int(self._steps() * self.skip)
        return jnp.where(step < dense_steps, int(Mode.DENSE), int(Mode.SPARSE))

    def _steps(self) -> int:
        if self.total_steps is None:
            raise ValueError("SpargeAttn with skip > 0 needs the generation's step count: pass it as "
                             "generate(..., method=SpargeAttn(...)), or call .bind(total_steps=)")
        return self.total_steps

    def attend(self, q, k, v, state, mode, **masks):
        if masks.get("kv_len") is not None:
            raise ValueError("SpargeAttn runs on LLaDA's full-sequence steps; SDAR block steps (a few queries "
                             "against a KV cache) are served by MAGE and FlashBlock")
        kernels.check_masks("SpargeAttn", masks)

        def dense(_):
            return kernels.dense(q, k, v, self.backend)

        def sparse(_):
            return kernels.call(pk.sparge_attention, pk.sparge_attention_reference, self.backend, q, k, v,
                                **self.kernel_args(state))

        out = jax.lax.cond(jnp.asarray(mode) == int(Mode.DENSE), dense, sparse, None)
        return out, state

    def kernel_args(self, state) -> dict:
        """`sparge_attention`'s keyword arguments for one layer's state."""
        return dict(simthreshd1=state["simthreshd1"], pvthreshd=state.get("pvthreshd"),
                    smooth_k=self.smooth_k, block_q=self.block_q, block_kv=self.block_kv,
                    attention_sink=self.attention_sink, **{self.selection_param: state[self.selection_param]})


CALIBRATED = ("simthreshd1", "cdfthreshd", "pvthreshd")  # the values a calibration file must hold
CALIBRATION_SETTINGS = ("block_q", "block_kv", "smooth_k")  # the settings it was tuned with, if recorded


def load_calibration(path) -> dict:
    """The JSON object of `dllm_jax.analysis.calibration.save_calibration`, checked to hold the
    values the policy needs (their types and ranges are checked by `SpargeAttn.from_calibration`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a SpargeAttn calibration file is a path, got {path!r} ({type(path).__name__})")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no SpargeAttn calibration file at {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not a valid calibration file (JSON): {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} must hold a JSON object, got a {type(data).__name__}")
    missing = [name for name in CALIBRATED if name not in data]
    if missing:
        raise ValueError(f"calibration file {path} lacks {missing}")
    # null would not be "no value": cdfthreshd=None selects topk instead, pvthreshd=None drops the PV filter
    empty = [name for name in CALIBRATED + CALIBRATION_SETTINGS if name in data and data[name] is None]
    if empty:
        raise ValueError(f"calibration file {path} has null for {empty}")
    return data
