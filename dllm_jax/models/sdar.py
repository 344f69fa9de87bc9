"""SDAR / TraDo in Flax NNX: Qwen3 layers (per-head q/k RMSNorm, RoPE over the whole head) run as a
block-diffusion LM (`dllm_jax.models.block_diffusion`: block-causal attention, an exact KV cache).

This module is SDAR's `BlockDecoder` and the block-diffusion functions bound to it: `forward`, `prefill`,
`cached_forward`, `block_step` and `commit_and_step` are `block_diffusion`'s with decoder=SDAR_DECODER.
"""

from __future__ import annotations

import functools

from dllm_jax.config import SDARConfig
from dllm_jax.models import block_diffusion
from dllm_jax.models.block_diffusion import BlockDecoder, BlockDiffusionLM, as_given, unrolled
from dllm_jax.models.layers import decoder_stack, lm_param_shapes, rope_tables

param_shapes = lm_param_shapes


def qwen3_tables(positions, config: SDARConfig):
    """RoPE cos/sin tables over the whole head (Qwen3 rotates every dimension)."""
    return rope_tables(positions, config.head_dim, config.rope_theta)


SDAR_DECODER = BlockDecoder(decoder_stack=decoder_stack, rope_tables=qwen3_tables, full_params=as_given,
                            cached_params=unrolled)

forward = functools.partial(block_diffusion.forward, decoder=SDAR_DECODER)
prefill = functools.partial(block_diffusion.prefill, decoder=SDAR_DECODER)
cached_forward = functools.partial(block_diffusion.cached_forward, decoder=SDAR_DECODER)
block_step = functools.partial(block_diffusion.block_step, decoder=SDAR_DECODER)
commit_and_step = functools.partial(block_diffusion.commit_and_step, decoder=SDAR_DECODER)


class SDAR(BlockDiffusionLM):
    """SDAR / TraDo block-diffusion LM (Qwen3 architecture); methods as `BlockDiffusionLM`."""

    decoder = SDAR_DECODER
