"""Model families: LLaDA (bidirectional masked diffusion), SDAR/TraDo (block diffusion)."""

from dllm_jax.models.llada import LLaDA
from dllm_jax.models.sdar import SDAR, KVCache

__all__ = ["LLaDA", "SDAR", "KVCache"]
