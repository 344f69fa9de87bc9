"""Attention: the dense default; sparse methods come as policies over `pallas_kernels`."""

from dllm_jax.attention.dense import dense_attention

__all__ = ["dense_attention"]
