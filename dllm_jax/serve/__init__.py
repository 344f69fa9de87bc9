"""Serving: continuous batching over block-diffusion slots (`Engine`)."""

from dllm_jax.serve.engine import Completion, Engine

__all__ = ["Completion", "Engine"]
