"""How many prompts `dllm-jax generate` decodes in one batch by default: as many as a coarse estimate of a
generation step's memory fits in the device's free memory, at most MAX_ROWS.

Per batch row over L = padded prompt + generated positions, `row_bytes` counts 4 bytes for each of: the
float32 logits and the sampler's copies of them (4 x vocab_size), the MLP activations (3 x
intermediate_size), hidden states and residuals (8 x hidden_size) and one layer's dense attention
scores (2 x num_heads x L). It is on the high side on purpose: SDAR and LLaDA2 run the vocabulary head on
a block only, and the Pallas kernels hold no scores. The budget is half the device's free memory
(jax `memory_stats()`: bytes_limit - bytes_in_use) once the weights (`weight_bytes`, split over the
tensor-parallel devices) are counted out; where the backend reports no memory (CPU) it is CPU_BUDGET.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dllm_jax.families import family_of

MAX_ROWS = 64  # past this a batch gains little speed, and an out-of-memory error costs more answers
CPU_BUDGET = 2 * 2**30  # bytes, where jax reports no device memory


def weight_bytes(config, dtype) -> int:
    """Bytes of the model's parameters in `dtype` (from the config's shapes: nothing is loaded)."""
    shapes = family_of(config).param_shapes(config)
    leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(shape) for shape in leaves) * jnp.dtype(dtype).itemsize


def row_bytes(config, length: int) -> int:
    """Estimated peak bytes one batch row of `length` positions adds to a generation step (module docstring)."""
    per_position = (4 * config.vocab_size + 3 * config.intermediate_size + 8 * config.hidden_size
                    + 2 * config.num_heads * length)
    return 4 * length * per_position


def activation_budget(config, dtype, *, tensor_parallel: int = 1, device=None) -> int:
    """Bytes a batch may take on `device` (default the first): half its free memory after the weights,
    CPU_BUDGET where jax reports none; never below 0."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return CPU_BUDGET
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - weight_bytes(config, dtype) // tensor_parallel
    return max(0, free // 2)


def least_step_bytes(config, length: int, rows: int, *, scores: bool) -> int:
    """A lower bound on what one forward over `rows` rows of `length` positions holds at once: every position's
    float32 hidden state and, with `scores` (attention as XLA's dense reference, as on the CPU backend), one
    layer's float32 attention scores [rows, num_heads, length, length]. A batch past it cannot run; the estimate
    of `row_bytes` is the one to size a batch by."""
    return 4 * rows * length * (config.hidden_size + (config.num_heads * length if scores else 0))


def available_bytes(device=None) -> int | None:
    """Bytes free on `device` (default the first): jax's `memory_stats()` where the backend reports it, else the
    host's available memory (/proc/meminfo MemAvailable); None where neither is known."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
