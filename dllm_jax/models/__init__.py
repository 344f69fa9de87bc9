"""Model families: LLaDA and Dream (bidirectional masked diffusion), SDAR/TraDo and LLaDA2 (block diffusion),
DiffusionGemma (canvases of uniform noise against an encoder's cache)."""

from dllm_jax.models.diffusion_gemma import DiffusionGemma
from dllm_jax.models.dream import Dream
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.llada2 import LLaDA2
from dllm_jax.models.block_diffusion import KVCache
from dllm_jax.models.sdar import SDAR

__all__ = ["DiffusionGemma", "Dream", "LLaDA", "LLaDA2", "SDAR", "KVCache"]
