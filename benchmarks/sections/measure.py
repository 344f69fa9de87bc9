"""What every section shares: the memory budget a point must fit, the bytes a forward reads, random
prompts, one synchronised call, and the rows of a skipped or failed point."""

from __future__ import annotations

import os
import time
import traceback

import jax
import numpy as np

MEMORY_FRACTION = 0.8  # points estimated to need more than this share of device memory are skipped
OUT_OF_TIME = "skipped: --budget-s spent before this measurement started"


def memory_budget() -> tuple[int | None, int]:
    """(bytes a run may fill, bytes in use) on the default device: MEMORY_FRACTION of the device's
    memory (the allocator's limit over its fraction), at most the allocator's limit; None where the
    backend does not say (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return None, 0
    device = limit / float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    return int(min(MEMORY_FRACTION * device, limit)), stats.get("bytes_in_use", 0)


def memory_verdict(need: int) -> str | None:
    """None if `need` more bytes fit in the memory budget next to what is in use, else the reason."""
    budget, in_use = memory_budget()
    if budget is None or in_use + need <= budget:
        return None
    return (f"skipped: needs ~{need / 1e9:.1f} GB (estimate) beside {in_use / 1e9:.1f} GB in use; the budget is "
            f"{budget / 1e9:.0f} GB ({MEMORY_FRACTION:.0%} of the device)")


def weight_bytes(params: dict, config) -> int:
    """Bytes of every weight one forward reads: all leaves but an untied embedding table (a gather
    of the step's rows; a tied one is read whole as the LM head)."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    return total if config.tie_word_embeddings else total - params["embed"].nbytes


def kv_bytes_per_position(config, itemsize: int = 2) -> int:
    """K and V of one position in every layer, for one row."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def activation_bytes(config, tokens: int) -> int:
    """A rough peak of one layer's bf16 activations over `tokens` tokens (gate/up and their product,
    the fused QKV, a few hidden-size buffers): the memory estimate's term for a prefill."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return tokens * (3 * config.intermediate_size + qkv + 4 * config.hidden_size) * 2


def random_ids(config, batch: int, length: int, seed: int) -> np.ndarray:
    """int32 [batch, length] random token ids below the mask id (no mask id in the prompt)."""
    high = min(config.mask_token_id, config.vocab_size)
    return np.random.default_rng(seed).integers(0, high, (batch, length)).astype(np.int32)


def timed(fn):
    """(seconds, result) of one synchronised call."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def with_copy(row: dict, tb_s: float | None, copy: dict | None) -> dict:
    """Adds the copy bandwidth of this process and the row's fraction of it."""
    if copy is None or tb_s is None:
        return row
    return row | dict(copy_tb_s=copy["copy_tb_s"], fraction_of_copy=tb_s / copy["copy_tb_s"])


def error_row(section: str, what: dict, e: BaseException) -> dict:
    print(f"{section} {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    traceback.print_exc()
    return dict(section=section, **what, error=f"{type(e).__name__}: {e}"[:400])
