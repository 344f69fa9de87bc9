"""dllm_jax: JAX/Pallas inference for diffusion language models.

Public API: `load_model`, `convert_hf_checkpoint`, `generate`, the configs, the models and the
sparse-attention methods.
"""

from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.attention.pulsecol import PulseCol
from dllm_jax.attention.sparge import SpargeAttn
from dllm_jax.attention.sparsed import SparseD
from dllm_jax.checkpoint import convert_hf_checkpoint, load_model
from dllm_jax.config import DreamConfig, LLaDA2Config, LLaDAConfig, SDARConfig, shipped_config
from dllm_jax.generate import generate  # the function (contract); the modules stay in dllm_jax.generate.*
from dllm_jax.models import SDAR, Dream, KVCache, LLaDA, LLaDA2

__all__ = ["AttentionPolicy", "Dense", "Dream", "DreamConfig", "FlashBlock", "KVCache", "LLaDA", "LLaDA2", "LLaDA2Config", "LLaDAConfig", "MAGE", "PulseCol", "SDAR", "SDARConfig", "SpargeAttn", "SparseD", "convert_hf_checkpoint",
           "generate", "load_model", "shipped_config"]
__version__ = "0.1.0"
