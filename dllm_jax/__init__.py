"""dllm_jax: JAX/Pallas inference for diffusion language models.

Public API: `load_model`, `convert_hf_checkpoint`, `generate`, the configs, the models and the
sparse-attention methods; `configure_compile_cache`. Importing the package turns on JAX's persistent compilation
cache in a folder of the user's own unless one is set already (`dllm_jax.compile_cache`).
"""

from dllm_jax import compile_cache

compile_cache.enable_default()  # before anything compiles: JAX opens its cache at the first compilation

from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.attention.pulsecol import PulseCol
from dllm_jax.attention.sparge import SpargeAttn
from dllm_jax.attention.sparsed import SparseD
from dllm_jax.checkpoint import convert_hf_checkpoint, load_model
from dllm_jax.compile_cache import configure as configure_compile_cache
from dllm_jax.config import DiffusionGemmaConfig, DreamConfig, LLaDA2Config, LLaDAConfig, SDARConfig, shipped_config
from dllm_jax.generate import generate  # the function (contract); the modules stay in dllm_jax.generate.*
from dllm_jax.models import SDAR, DiffusionGemma, Dream, KVCache, LLaDA, LLaDA2

__all__ = ["AttentionPolicy", "Dense", "DiffusionGemma", "DiffusionGemmaConfig", "Dream", "DreamConfig", "FlashBlock", "KVCache", "LLaDA", "LLaDA2", "LLaDA2Config", "LLaDAConfig", "MAGE", "PulseCol", "SDAR", "SDARConfig", "SpargeAttn", "SparseD", "configure_compile_cache", "convert_hf_checkpoint",
           "generate", "load_model", "shipped_config"]
__version__ = "0.1.0"
