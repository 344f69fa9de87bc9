"""Model families: LLaDA and Dream (bidirectional masked diffusion), SDAR/TraDo (block diffusion)."""

from dllm_jax.models.dream import Dream
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.llada2 import LLaDA2
from dllm_jax.models.block_diffusion import KVCache
from dllm_jax.models.sdar import SDAR

__all__ = ["Dream", "LLaDA", "LLaDA2", "SDAR", "KVCache"]
