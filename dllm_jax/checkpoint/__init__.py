"""Checkpoints: HF safetensors -> parameter tree (`hf`), Orbax storage (`orbax`), the commit
manifest and checksums (`manifest`), safe writing and replacing (`atomic`), the public API (`api`)."""

from dllm_jax.checkpoint.api import convert_hf_checkpoint, load_model, model_from_params

__all__ = ["convert_hf_checkpoint", "load_model", "model_from_params"]
