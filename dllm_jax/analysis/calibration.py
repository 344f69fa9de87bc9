"""SpargeAttn's per-head hyperparameter calibration (paper §3.6, the official autotune): a tool that
runs a model to tune the `dllm_jax.attention.sparge.SpargeAttn` policy, whose `from_calibration`
reads the JSON file `save_calibration` writes.

Calibration (`calibrate`), per query head in parallel, on a few sample (q, k, v) of one layer:
  for simthreshd1 in {-1, -15/16, ..., 15/16}:
    bisect cdfthreshd in [0, 1] (start 0.1, tolerance 0.001) for the smallest value with L1 < l1
    (no PV filter); then bisect pvthreshd in [0, 50] (start 20, tolerance 0.1) for the smallest with
    L1 < pv_l1; evaluate the pair once more for its both-stage sparsity and L1;
  keep, per head, the verified point with the largest sparsity (heads under `min_sparsity` stay
  dense: simthreshd1 = cdfthreshd = 1, pvthreshd = 50). A head's sweep stops once its map sparsity
  falls below min_sparsity after having been above it (the official sweep stops at the first such
  row, even at simthreshd1 = -1, which ends heads that need fix blocks before they are tuned).
  L1 = sum |o - o_dense| / sum |o_dense| over all samples, per head. Deviations from the official
  autotune, for a guarantee it lacks: the returned values are ones that were evaluated and met the
  bound on the samples (the official code returns the bisection midpoint and then takes the maximum of
  each value over two neighbouring simthreshd1 rows), all samples are scored jointly instead of one at
  a time, and the sweep ranks by both-stage sparsity.

`calibrate_llada` runs `calibrate` on every layer of a LLaDA model, from the (q, k, v) each attention
layer sees (`layer_inputs`).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels as pk
from dllm_jax.attention import kernels
from dllm_jax.attention.sparge import DENSE_HEAD
from dllm_jax.files import write_atomic
from dllm_jax.models.llada import logits_through


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-head hyperparameters f32 [Hq] (or [L, Hq] for a model) with the sparsity and L1 error they
    reached on the calibration samples (both stages)."""

    simthreshd1: np.ndarray
    cdfthreshd: np.ndarray
    pvthreshd: np.ndarray
    sparsity: np.ndarray
    l1: np.ndarray
    settings: dict = dataclasses.field(default_factory=dict)


def relative_l1(out, reference) -> jax.Array:
    """sum |out - reference| / sum |reference| per query head, f32 [Hq], for [B, N, Hq, D] arrays."""
    out, reference = out.astype(jnp.float32), reference.astype(jnp.float32)
    return jnp.sum(jnp.abs(out - reference), axis=(0, 1, 3)) / jnp.sum(jnp.abs(reference), axis=(0, 1, 3))


def calibrate(samples, *, l1: float = 0.05, pv_l1: float = 0.06, block_q: int = 64, block_kv: int = 128,
              smooth_k: bool = True, sim_steps: int = 16, cdf_tol: float = 1e-3, pv_max: float = 50.0,
              pv_tol: float = 0.1, min_sparsity: float = 0.1, backend: str = "auto",
              progress: bool = False) -> Calibration:
    """Per-head SpargeAttn hyperparameters for one attention layer (see the module docstring).

    samples: a list of (q [B, N, Hq, D], k, v [B, N, Hkv, D]) from that layer on representative inputs.
    l1: the bound for the predicted map alone; pv_l1 (>= l1): the bound with the PV filter too.
    Returns a `Calibration` of f32 [Hq] arrays.
    """
    if not samples:
        raise ValueError("calibrate needs at least one (q, k, v) sample")
    if not 0 < l1 <= pv_l1:
        raise ValueError(f"need 0 < l1 <= pv_l1, got l1={l1}, pv_l1={pv_l1}")
    kernels.check_backend(backend)
    num_heads = samples[0][0].shape[2]
    exact = [kernels.dense(q, k, v, backend) for q, k, v in samples]
    settings = dict(block_q=block_q, block_kv=block_kv, smooth_k=smooth_k, l1=l1, pv_l1=pv_l1)

    @jax.jit
    def score(samples, exact, sim, cdf, pv):
        err_num = err_den = kept = total = 0.0
        for (q, k, v), ref in zip(samples, exact):
            out, sparsity = kernels.call(
                pk.sparge_attention, pk.sparge_attention_reference, backend, q, k, v, simthreshd1=sim,
                cdfthreshd=cdf, pvthreshd=pv, smooth_k=smooth_k, block_q=block_q, block_kv=block_kv,
                return_sparsity=True)
            out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
            err_num += jnp.sum(jnp.abs(out - ref), axis=(0, 1, 3))
            err_den += jnp.sum(jnp.abs(ref), axis=(0, 1, 3))
            kept += jnp.sum(sparsity.pv, axis=0)
            total += jnp.sum(sparsity.total, axis=0)
        return err_num / err_den, 1.0 - kept / total

    def evaluate(sim, cdf, pv):
        """(L1 [Hq], both-stage sparsity [Hq]) over all samples; pv None: no PV filter."""
        return score(samples, exact, sim, cdf, pv)

    def bisect(score, low, high, start, tol, bound):
        """Per head: the smallest value in [low, high] with score(value) < bound (high if none passed)."""
        lo, hi = np.full(num_heads, low, np.float32), np.full(num_heads, high, np.float32)
        cur = np.full(num_heads, start, np.float32)
        while (hi - lo > tol).any():
            err = np.asarray(score(cur))
            active = hi - lo > tol
            ok = err < bound
            hi = np.where(active & ok, cur, hi)
            lo = np.where(active & ~ok, cur, lo)
            cur = np.where(active, (lo + hi) / 2, cur)
        return hi

    best = {name: np.full(num_heads, value, np.float32) for name, value in DENSE_HEAD.items()}
    best_sparsity = np.zeros(num_heads, np.float32)
    best_l1 = np.asarray(evaluate(best["simthreshd1"], best["cdfthreshd"], best["pvthreshd"])[0])
    # the official sweep stops once the map sparsity falls below min_sparsity; a head stops here only
    # after it had some, so heads that first need fix blocks to meet the bound are still tuned
    seen, done = np.zeros(num_heads, bool), np.zeros(num_heads, bool)
    grid = [i / sim_steps for i in range(-sim_steps, sim_steps)]
    for sim_value in tqdm(grid, desc="SpargeAttn calibration", disable=not progress):
        sim = np.full(num_heads, sim_value, np.float32)
        cdf = bisect(lambda c: evaluate(sim, c, None)[0], 0.0, 1.0, 0.1, cdf_tol, l1)
        map_sparsity = np.asarray(evaluate(sim, cdf, None)[1])
        pv = bisect(lambda p: evaluate(sim, cdf, p)[0], 0.0, pv_max, 20.0, pv_tol, pv_l1)
        err, sparsity = (np.asarray(x) for x in evaluate(sim, cdf, pv))
        better = ~done & (err < pv_l1) & (sparsity > best_sparsity)
        for name, value in (("simthreshd1", sim), ("cdfthreshd", cdf), ("pvthreshd", pv)):
            best[name] = np.where(better, value, best[name])
        best_sparsity = np.where(better, sparsity, best_sparsity)
        best_l1 = np.where(better, err, best_l1)
        done |= seen & (map_sparsity < min_sparsity)
        seen |= map_sparsity >= min_sparsity
        if done.all():
            break
    dense = best_sparsity <= min_sparsity
    for name, value in DENSE_HEAD.items():
        best[name] = np.where(dense, value, best[name])
    if dense.any():
        err, sparsity = (np.asarray(x) for x in evaluate(best["simthreshd1"], best["cdfthreshd"], best["pvthreshd"]))
        best_l1, best_sparsity = np.where(dense, err, best_l1), np.where(dense, sparsity, best_sparsity)
    return Calibration(sparsity=best_sparsity, l1=best_l1, settings=settings, **best)


def layer_inputs(model, input_ids):
    """The (q, k, v) every attention layer of a LLaDA model sees for input_ids [B, N] (after RoPE):
    arrays [L, B, N, H, D] in the model's dtype."""
    config = model.config
    b, n = np.shape(input_ids)
    shapes = [(config.num_layers, b, n, heads, config.head_dim)
              for heads in (config.num_heads, config.num_kv_heads, config.num_kv_heads)]

    def attend(q, k, v, captured, layer):
        captured = tuple(c.at[layer].set(x.astype(c.dtype)) for c, x in zip(captured, (q, k, v)))
        return kernels.dense(q, k, v, "auto"), captured

    @jax.jit
    def run(params, ids):
        dtype = params["embed"].dtype
        captured = tuple(jnp.zeros(s, dtype) for s in shapes)
        return logits_through(params, ids, attend, captured, config=config, logits_from=n - 1)[1]

    return run(model.params(), jnp.asarray(input_ids, jnp.int32))


def calibrate_llada(model, inputs, *, progress: bool = True, **options) -> Calibration:
    """`calibrate` for every layer of a LLaDA model on a few token sequences `inputs` (each [B, N],
    e.g. prompts followed by [MASK] tokens as at a denoising step); returns [L, Hq] arrays."""
    captured = [layer_inputs(model, ids) for ids in inputs]
    layers = []
    for layer in tqdm(range(model.config.num_layers), desc="SpargeAttn calibration (layers)", disable=not progress):
        layers.append(calibrate([tuple(x[layer] for x in sample) for sample in captured], **options))
    stack = {name: np.stack([getattr(c, name) for c in layers])
             for name in ("simthreshd1", "cdfthreshd", "pvthreshd", "sparsity", "l1")}
    return Calibration(settings=layers[0].settings, **stack)


def save_calibration(path, calibration: Calibration) -> None:
    """Writes the calibration as JSON (values per layer and head, the settings they assume)."""
    data = {name: np.asarray(getattr(calibration, name)).tolist()
            for name in ("simthreshd1", "cdfthreshd", "pvthreshd", "sparsity", "l1")}
    write_atomic(path, json.dumps(dict(data, **calibration.settings), indent=1) + "\n")
