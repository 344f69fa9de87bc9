"""dllm_jax: JAX/Pallas inference for diffusion language models.

Public API: `load_model`, `convert_hf_checkpoint`, the configs and the models.
"""

from dllm_jax.checkpoint import convert_hf_checkpoint, load_model
from dllm_jax.config import LLaDAConfig, SDARConfig, shipped_config
from dllm_jax.models import SDAR, KVCache, LLaDA

__all__ = ["KVCache", "LLaDA", "LLaDAConfig", "SDAR", "SDARConfig", "convert_hf_checkpoint", "load_model",
           "shipped_config"]
__version__ = "0.1.0"
