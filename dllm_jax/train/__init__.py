"""Training of tiny LLaDA and SDAR models with optax: the masked-diffusion (LLaDA) and block-diffusion
(SDAR, two-copy BD3-LM mask) losses, batches from task samples, a checkpointed loop, HF export.
Command line: `python -m dllm_jax.train --help`."""

from dllm_jax.train.data import Batch, BatchSource, BucketedSource, Prefetcher, pack
from dllm_jax.train.losses import llada_loss, sdar_loss, two_copy_mask
from dllm_jax.train.export import export_hf
from dllm_jax.train.loop import train
from dllm_jax.train.run_folder import Diverged
from dllm_jax.train.state import TrainConfig, TrainResult, TrainState
from dllm_jax.train.surgery import init_params

__all__ = ["Batch", "BatchSource", "BucketedSource", "Diverged", "Prefetcher", "TrainConfig", "TrainResult", "TrainState",
           "export_hf", "init_params", "llada_loss", "pack", "sdar_loss", "train", "two_copy_mask"]
