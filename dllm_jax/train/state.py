"""What a training run is configured by (`TrainConfig`) and what it carries and returns (`TrainState`,
`StepMetrics`, `TrainResult`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import struct

from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.train.attention import CHUNK
from dllm_jax.validation import flag, integer, real

COMPUTE_DTYPES = ("bfloat16", "float32")
FAMILIES = {"llada": LLaDAConfig, "sdar": SDARConfig}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. The family ("llada" | "sdar") is the model config's (`family` property).

    The learning rate warms up linearly from 0 over `warmup_steps`, then follows a cosine to
    `final_lr_fraction * learning_rate` at `steps`. Weight decay skips the norm weights.
    `checkpoint_every=0` saves only at the end of each `train` call; `run_dir=None` keeps nothing on disk.
    `seq_length` is the longest batch the run trains on (checked against the model's positions); batches
    may be shorter (one per context bucket, `data.BucketedSource`): the step compiles once per length.
    `stratified_t` draws a batch's masking ratios as one stratified sample (`losses.stratified_uniform`)
    instead of iid. `attention_chunk` is the training attention's queries per chunk
    (dllm_jax.train.attention: no [L, L] memory at any length); it sets memory, not the loss. None
    attends through materialised [L, L] masks instead: the reference the tests and the benchmark compare.
    """

    model: LLaDAConfig | SDARConfig
    steps: int
    batch_size: int
    seq_length: int
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    eps: float = 1e-3  # masking ratios t are drawn from U(eps, 1)
    stratified_t: bool = False
    attention_chunk: int | None = CHUNK  # queries per chunk of the training attention (dllm_jax.train.attention)
    run_dir: str | None = None
    checkpoint_every: int = 0
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.model, tuple(FAMILIES.values())):
            raise ValueError(f"TrainConfig.model must be an LLaDAConfig or SDARConfig, got {type(self.model).__name__}")
        for name in ("steps", "batch_size", "seq_length", "log_every"):
            object.__setattr__(self, name, integer(f"TrainConfig.{name}", getattr(self, name)))
        if self.attention_chunk is not None:
            object.__setattr__(self, "attention_chunk", integer("TrainConfig.attention_chunk", self.attention_chunk))
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            object.__setattr__(self, name, integer(f"TrainConfig.{name}", getattr(self, name), minimum=0))
        if self.warmup_steps >= self.steps:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be below steps={self.steps}")
        object.__setattr__(self, "learning_rate", real("TrainConfig.learning_rate", self.learning_rate, low=0,
                                                       low_open=True))
        for name in ("final_lr_fraction", "weight_decay"):
            object.__setattr__(self, name, real(f"TrainConfig.{name}", getattr(self, name), low=0))
        object.__setattr__(self, "grad_clip", real("TrainConfig.grad_clip", self.grad_clip, low=0, low_open=True))
        object.__setattr__(self, "eps", real("TrainConfig.eps", self.eps, low=0, high=1, low_open=True,
                                             high_open=True))
        object.__setattr__(self, "stratified_t", flag("TrainConfig.stratified_t", self.stratified_t))
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"TrainConfig.compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.seq_length > self.model.max_position_embeddings:
            raise ValueError(f"TrainConfig.seq_length={self.seq_length} exceeds the model's "
                             f"max_position_embeddings={self.model.max_position_embeddings}")

    @property
    def family(self) -> str:
        return self.model.family

    def to_json(self) -> dict:
        """The configuration as JSON (the model as its HF config.json dict)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        return dict(values, family=self.family, model=self.model.to_hf_config())


@struct.dataclass
class TrainState:
    """The loop carry: everything a resume needs."""

    params: dict  # float32, checkpoint layout
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: steps done
    rng: jax.Array  # uint32 [2]: the key the next step splits


@struct.dataclass
class StepMetrics:
    """Scalars of one training step."""

    loss: jax.Array
    ce: jax.Array  # mean CE over masked positions
    grad_norm: jax.Array  # before clipping
    learning_rate: jax.Array  # the rate this step applied


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train` returns: the final state and the loss history of the whole run (resumed parts too)."""

    state: TrainState
    history: tuple[dict, ...]  # per step: {"step", "loss", "ce", "grad_norm", "learning_rate"}

    @property
    def params(self) -> dict:
        return self.state.params

    @property
    def losses(self) -> np.ndarray:
        return np.array([record["loss"] for record in self.history], np.float32)
