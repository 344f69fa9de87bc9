"""Model families: LLaDA (bidirectional masked diffusion)."""

from dllm_jax.models.llada import LLaDA

__all__ = ["LLaDA"]
