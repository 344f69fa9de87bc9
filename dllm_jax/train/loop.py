"""The training loop: optax AdamW, one jitted step, Orbax checkpoint/resume, loss history and plot,
and the export of trained weights as an HF checkpoint `dllm_jax.load_model` reads.

Parameters are trained in the checkpoint layout of dllm_jax.models.layers (stacked layers, one tensor
per projection; what the HF name maps convert to and from) and kept in float32; the forward runs in
`compute_dtype` (mixed precision: the loss casts the float32 master weights, so gradients and optimizer
state stay float32).

A run directory holds:
  checkpoints/<step>/         Orbax (CheckpointManager) trees of {params, opt_state, step, rng}; the last two
  checkpoint_checksums.json   CRC-32 of every array of each kept checkpoint, written before it commits
  train_config.json           the run's configuration and batch settings (a resume must match them)
  history.json                the per-step loss record, rewritten at every checkpoint
  loss.png                    the loss curve (when matplotlib is installed)
Every JSON file is replaced atomically (`dllm_jax.files.write_atomic`). A run directory is new, empty or
a run's own, never inside another run (`check_run_location`); a non-finite loss or state stops the run
before it is saved (`Diverged`), so the kept checkpoints are always finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from tqdm.auto import tqdm

from dllm_jax.checkpoint.api import SIDE_FILES
from dllm_jax.checkpoint.hf import hf_name, invert_transform, rules_for, tree_get
from dllm_jax.checkpoint.hf_write import INDEX_FILE, write_hf_files
from dllm_jax.checkpoint.manifest import CHUNK_BYTES, file_checksum, files_under, tree_checksums
from dllm_jax.checkpoint.orbax import tree_paths
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.models.layers import lm_param_shapes
from dllm_jax.train.attention import CHUNK
from dllm_jax.train.data import Batch, Prefetcher
from dllm_jax.train.losses import LossMetrics, llada_logits, llada_loss, sdar_loss
from dllm_jax.files import write_atomic
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


def init_params(config: LLaDAConfig | SDARConfig, key) -> dict:
    """Fresh float32 parameters in the checkpoint layout: norms 1, every other weight N(0, 0.02²)
    (logits start near 0, so the loss starts near log(vocab_size))."""
    shapes = lm_param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = list(tree_paths(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    keys = jax.random.split(key, len(leaves))
    values = [jnp.ones(shape, jnp.float32) if path.endswith("norm") else 0.02 * jax.random.normal(k, shape)
              for path, shape, k in zip(paths, leaves, keys)]
    return jax.tree.unflatten(treedef, values)


RESIDUAL_OUTPUTS = ("o_proj", "down_proj")  # what a layer adds to the residual stream goes through these


def grow_layers(params: dict, num_layers: int) -> dict:
    """Checkpoint-layout `params` deepened to `num_layers` decoder layers (a multiple of the current n):
    each trained layer is followed by num_layers / n - 1 copies of itself whose output projections
    (`RESIDUAL_OUTPUTS`) are zero. A zero-output layer adds nothing to the residual stream, so the grown
    model computes exactly what the trained one did, and training starts from there with the copies'
    attention and MLP weights already meaningful (zero-initialised residual branches, as in ReZero and
    progressive stacking). Returns new float32 arrays; ValueError for a depth that is not a multiple."""
    layers = params["layers"]
    n = int(np.shape(layers["o_proj"])[0])
    num_layers = integer("num_layers", num_layers)
    if num_layers % n:
        raise ValueError(f"grow_layers: {num_layers} layers is not a multiple of the model's {n}")
    copies = num_layers // n
    order = np.repeat(np.arange(n), copies)  # layer i, then its copies
    trained = np.arange(num_layers) % copies == 0
    grown = {}
    for name, value in layers.items():
        value = jnp.asarray(value, jnp.float32)[order]
        if name in RESIDUAL_OUTPUTS:
            value = value * jnp.asarray(trained, jnp.float32).reshape((-1,) + (1,) * (value.ndim - 1))
        grown[name] = value
    return {**params, "layers": grown}


def widen_heads(params: dict, config, head_dim: int) -> dict:
    """Checkpoint-layout `params` of a model with a head_dim field (SDAR) widened to `head_dim` (a
    multiple f of the current), computing what the trained model did: old dimension j of each half of
    a head moves to f·j of that half, where half-rotation RoPE gives it the same frequency
    (theta^(-2j/D) = theta^(-2fj/fD)); the new dimensions start at zero (zero query, key, value and
    output weights, zero q/k norm weights). The logit scale 1/sqrt(head_dim) falls by sqrt(f), and the
    q/k RMSNorm statistics, taken over f times the dimensions, grow the normalised values by sqrt(f) (up
    to the norm's eps): the key norm weights divided by sqrt(f) make up for both. This is how the trained
    32-wide heads become the 64- or 128-wide heads the Hopper kernels take. Returns new float32 arrays;
    ValueError for a width that is not a multiple, or a model without a head_dim field and q/k norms."""
    if "head_dim" not in {f.name for f in dataclasses.fields(config)} or not config.qk_norm:
        raise ValueError(f"{type(config).__name__}: widen_heads needs a head_dim field (LLaDA's is hidden_size / "
                         "num_heads) and q/k RMSNorm (SDAR)")
    old = config.head_dim
    head_dim = integer("head_dim", head_dim)
    if head_dim % old:
        raise ValueError(f"widen_heads: head_dim {head_dim} is not a multiple of the model's {old}")
    f, half = head_dim // old, old // 2
    index = np.concatenate([f * np.arange(half), f * np.arange(half) + head_dim // 2])  # new place of each old dim
    gain = {"k_norm": f ** -0.5}
    axis = {"q_proj": 3, "k_proj": 3, "v_proj": 3, "q_bias": 2, "k_bias": 2, "v_bias": 2, "o_proj": 2,
            "q_norm": 1, "k_norm": 1}
    layers = {}
    for name, value in params["layers"].items():
        value = jnp.asarray(value, jnp.float32)
        if name in axis:
            shape = list(value.shape)
            shape[axis[name]] = head_dim
            at = (slice(None),) * axis[name] + (index,)
            value = jnp.zeros(shape, jnp.float32).at[at].set(value * gain.get(name, 1.0))
        layers[name] = value
    return {**params, "layers": layers}


def regroup_heads(params: dict, config, num_heads: int) -> dict:
    """Checkpoint-layout `params` with each group of f = config.num_heads / `num_heads` query heads (and f
    KV heads) merged into one f times wider head, the hidden size unchanged: the only way to widen the heads
    of a model whose head_dim is hidden_size / num_heads (LLaDA). Lossy by construction, a warm start to
    train on: a merged head takes one softmax over the sum of its members' logits, and its members' values
    share that softmax. Member r of a group takes dimensions f·j + r of each RoPE half, so member 0 keeps
    its frequencies exactly (theta^(-2j/D) = theta^(-2fj/fD)) and the others' shift by under one old step.
    The query weights gain sqrt(f) for the 1/sqrt(head_dim) scale. Member r of query head h (KV group
    c = h // G, G query heads per KV head) is the old query head (f·c + r)·G + h % G, whose KV head is the
    old f·c + r: member r of the new KV head c, so each old query still meets its own keys. Returns new
    float32 arrays; ValueError for a head count that does not divide both head counts."""
    if config.qk_norm:
        raise ValueError(f"{type(config).__name__}: regroup_heads takes models without q/k norms (LLaDA); widen "
                         "an SDAR's heads with widen_heads")
    old_heads, old_kv = config.num_heads, config.num_kv_heads
    num_heads = integer("num_heads", num_heads)
    if old_heads % num_heads or old_kv % (old_heads // num_heads):
        raise ValueError(f"regroup_heads: {num_heads} heads do not divide the model's {old_heads} query and "
                         f"{old_kv} KV heads by one factor")
    f, group, dim = old_heads // num_heads, old_heads // old_kv, config.head_dim
    half = dim // 2
    index = np.concatenate([f * np.arange(half), f * np.arange(half) + f * half])  # member 0's new dimensions
    new_kv = old_kv // f
    q_members = [[(f * (h // group) + r) * group + h % group for r in range(f)] for h in range(num_heads)]
    kv_members = [[f * c + r for r in range(f)] for c in range(new_kv)]

    def merge(value, head_axis, members, gain=1.0):
        value = jnp.asarray(value, jnp.float32) * gain
        shape = list(value.shape)
        shape[head_axis], shape[head_axis + 1] = len(members), f * dim
        out = jnp.zeros(shape, jnp.float32)
        lead = (slice(None),) * head_axis
        for new, olds in enumerate(members):
            for r, old in enumerate(olds):
                out = out.at[lead + (new, index + r)].set(value[lead + (old,)])
        return out

    heads = {"q_proj": (2, q_members, f ** 0.5), "q_bias": (1, q_members, f ** 0.5), "o_proj": (1, q_members, 1.0),
             "k_proj": (2, kv_members, 1.0), "v_proj": (2, kv_members, 1.0), "k_bias": (1, kv_members, 1.0),
             "v_bias": (1, kv_members, 1.0)}
    layers = {name: merge(value, *heads[name]) if name in heads else jnp.asarray(value, jnp.float32)
              for name, value in params["layers"].items()}
    return {**params, "layers": layers}


def schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, config.steps,
                                              end_value=config.final_lr_fraction * config.learning_rate)


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (b2 = 0.95), no weight decay on norm weights."""
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: not str(path[-1].key).endswith("norm"), params)

    return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                       optax.adamw(schedule(config), b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                                   mask=decay_mask))


def loss_fn(config: TrainConfig) -> Callable:
    """(params, tokens, loss_mask, lengths, key) -> (loss, LossMetrics) of the config's family, computing
    in `compute_dtype` from float32 params. LLaDA hides each row's padding (positions >= lengths) from
    every query, so a padded row is seen as generation sees it alone; SDAR's block-causal attention
    never lets earlier positions see the padding after them."""
    model, dtype = config.model, jnp.dtype(config.compute_dtype)

    def loss(params, tokens, loss_mask, lengths, key):
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        if config.family == "llada":
            def logits(params, ids):
                return llada_logits(params, ids, lengths, config=model, chunk=config.attention_chunk)

            return llada_loss(logits, params, tokens, loss_mask, key, mask_token_id=model.mask_token_id,
                              eps=config.eps, stratified=config.stratified_t)
        return sdar_loss(params, tokens, loss_mask, key, config=model, eps=config.eps, stratified=config.stratified_t,
                         chunk=config.attention_chunk)

    return loss


def initial_state(config: TrainConfig, params: dict | None = None) -> TrainState:
    """Step 0: `params` (copied to float32, checked against the model's shapes) or fresh ones."""
    init_key, rng = jax.random.split(jax.random.PRNGKey(config.seed))
    if params is None:
        params = init_params(config.model, init_key)
    else:
        check_param_shapes(params, config.model)
        params = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)  # the step donates its state
    # one program for the optimizer's state (its zeros made leaf by leaf would compile a program per shape)
    opt_state = jax.jit(optimizer(config).init)(params)
    return TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32), rng=rng)


def check_param_shapes(params: dict, model) -> None:
    """ValueError listing every tensor missing, unexpected or mis-shaped for the checkpoint layout of `model`."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    expected = tree_paths(lm_param_shapes(model), is_leaf=is_shape)
    found = {path: tuple(np.shape(x)) for path, x in tree_paths(params).items()}
    problems = [f"{p}: missing" for p in expected if p not in found]
    problems += [f"{p}: unexpected" for p in found if p not in expected]
    problems += [f"{p}: shape {list(found[p])}, expected {list(s)}" for p, s in expected.items()
                 if p in found and found[p] != s]
    if problems:
        raise ValueError("params do not fit the model config in the checkpoint layout (stacked layers, "
                         "dllm_jax.models.layers.lm_param_shapes):\n  " + "\n  ".join(problems))


def step_config(config: TrainConfig) -> TrainConfig:
    """The config with the fields the step never reads blanked, so that runs differing only in
    bookkeeping (run directory, logging, checkpoint interval) share one compilation."""
    return dataclasses.replace(config, run_dir=None, checkpoint_every=0, log_every=1)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def train_step(state: TrainState, tokens, loss_mask, lengths, *, config: TrainConfig) -> tuple[TrainState, StepMetrics]:
    """One optimizer step on tokens int32 [B, L] with loss_mask bool [B, L] and real lengths int32 [B]
    (compiled once per L: a bucketed run has a few)."""
    rng, key = jax.random.split(state.rng)
    (loss, metrics), grads = jax.value_and_grad(loss_fn(config), has_aux=True)(state.params, tokens, loss_mask,
                                                                               lengths, key)
    updates, opt_state = optimizer(config).update(grads, state.opt_state, state.params)
    metrics: LossMetrics
    step_metrics = StepMetrics(loss=loss, ce=metrics.ce, grad_norm=optax.tree.norm(grads),
                               learning_rate=schedule(config)(state.step))
    state = TrainState(params=optax.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1,
                       rng=rng)
    return state, step_metrics


def train(config: TrainConfig, batches: Callable[[int], Batch], *, params: dict | None = None, resume: bool = False,
          stop_at: int | None = None, max_seconds: float | None = None, progress: bool = True,
          data_workers: int = 0, batch_settings: dict | None = None) -> TrainResult:
    """Trains from step 0 (or the latest checkpoint of `config.run_dir` with resume=True) up to
    `config.steps`, or only up to `stop_at` (a partial run of the same schedule, to resume later).

    Nothing is lost: a loss, gradient or state that turns NaN or Inf stops the run with a ValueError
    (`Diverged`) before anything non-finite is saved, so the last checkpoint on disk (and an export made
    from it) stays the last finite one; checkpoints carry CRC-32 checksums, checked with the values'
    finiteness when a run resumes; the JSON side files are replaced atomically.

    Args:
      batches: `batches(step) -> Batch` [batch_size, L <= seq_length] for every step (a pure function of
        the step, e.g. `data.BatchSource` or `data.BucketedSource`, so a resumed run sees the batches an
        uninterrupted one would).
      params: initial float32 params in the checkpoint layout (default: `init_params` from the seed);
        ignored when resuming from a checkpoint.
      resume: continue from the latest checkpoint in run_dir (starting afresh if there is none). Without
        it, a run_dir that already holds checkpoints is refused.
      max_seconds: also stop once this much wall time has passed in the loop (checked after each step;
        the state is checkpointed as at `stop_at`, so the run resumes from there).
      progress: a tqdm bar with the loss and tokens/s, refreshed every `log_every` steps.
      data_workers: build the batches ahead in this many background processes (`data.Prefetcher`;
        `batches` must then pickle); 0 builds each one in the loop.
      batch_settings: JSON values of whatever shapes the batches beyond `config` (tasks, contexts, task
        options, ...): recorded in train_config.json under "batches", and a resume must match them.
    Returns:
      TrainResult with the final state (checkpointed to run_dir if set) and the per-step loss history.
    """
    end = config.steps if stop_at is None else integer("stop_at", stop_at, maximum=config.steps)
    deadline = None if max_seconds is None else time.monotonic() + real("max_seconds", max_seconds, low=0)
    data_workers = integer("data_workers", data_workers, minimum=0)
    run = None if config.run_dir is None else Run(Path(config.run_dir))
    state, history = initial_state(config, params), []
    manager = None if run is None else run.open(config, resume=resume, batch_settings=batch_settings)
    try:
        if manager is not None and manager.latest_step() is not None:
            state = run.restore(manager, state)
            history = [r for r in run.read_history() if r["step"] <= int(state.step)]
        with contextlib.ExitStack() as stack:
            if data_workers:
                batches = stack.enter_context(Prefetcher(batches, data_workers))
            state, history = run_steps(config, batches, state, history, end=end, run=run, manager=manager,
                                       progress=progress, deadline=deadline)
        if manager is not None:
            if manager.latest_step() != int(state.step):
                run.save(manager, state, history)
            run.record_files(manager)  # waits for the last save to commit
            run.write_history(history, plot=True)
    finally:
        if manager is not None:
            manager.close()
    return TrainResult(state=state, history=tuple(history))


class Diverged(ValueError):
    """Training met a NaN or Inf (loss, gradient norm or state); nothing from that point was saved."""


def run_steps(config: TrainConfig, batches, state: TrainState, history: list[dict], *, end: int, run, manager,
              progress: bool, deadline: float | None = None) -> tuple[TrainState, list[dict]]:
    """Steps state.step..end-1, or fewer if time.monotonic() passes `deadline`: (final state, `history`
    followed by their records). Metrics are fetched from the device only every log_every steps (no
    per-step host sync), before each checkpoint, and at the last step; a non-finite one raises `Diverged`
    (after writing the history so far, the bad record included, for the plot)."""
    jit_config, start = step_config(config), int(state.step)
    history, pending = list(history), []
    bar = tqdm(total=config.steps, initial=start, desc=f"train {config.family}", unit="step", disable=not progress)
    clock, tokens_since = time.perf_counter(), 0

    def fetch():
        nonlocal pending, clock, tokens_since
        if not pending:
            return
        fetched = jax.device_get([m for _, m in pending])
        records = [{"step": s, "loss": float(m.loss), "ce": float(m.ce), "grad_norm": float(m.grad_norm),
                    "learning_rate": float(m.learning_rate)} for (s, _), m in zip(pending, fetched)]
        history.extend(records)
        bad = next((r for r in records if not all(math.isfinite(r[k]) for k in ("loss", "grad_norm"))), None)
        if bad is not None:
            bar.close()
            if run is not None:
                run.write_history(history, plot=False)
            raise Diverged(diverged_message(bad, run, manager))
        now = time.perf_counter()
        bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", tok_s=f"{tokens_since / (now - clock):.0f}")
        bar.update(len(pending))
        pending, clock, tokens_since = [], now, 0

    for step in range(start, end):
        batch = batches(step)
        check_batch(batch, config, step)
        state, metrics = train_step(state, jnp.asarray(batch.tokens), jnp.asarray(batch.loss_mask),
                                    jnp.asarray(batch.lengths), config=jit_config)
        pending.append((step + 1, metrics))
        tokens_since += batch.tokens.size
        last = step + 1 == end or (deadline is not None and time.monotonic() > deadline)
        save = manager is not None and config.checkpoint_every and (step + 1) % config.checkpoint_every == 0
        if (step + 1) % config.log_every == 0 or last or save:
            fetch()
        if save:
            run.save(manager, state, history)
        if last:
            break
    bar.close()
    return state, history


def diverged_message(record: dict, run, manager) -> str:
    kept = None if manager is None else manager.latest_step()
    where = ("nothing was saved" if run is None else
             f"nothing after step {kept} was saved: {run.directory / CHECKPOINTS / str(kept)} is the last checkpoint"
             if kept is not None else "no checkpoint was saved")
    return (f"training diverged: loss {record['loss']}, gradient norm {record['grad_norm']} at step {record['step']} "
            f"(learning rate {record['learning_rate']:.3g}); {where}. Try a lower learning rate or a stronger "
            "gradient clip, from scratch or from an export of that checkpoint")


def all_finite(tree) -> bool:
    """Whether every floating leaf of `tree` is finite (one compiled reduction, one host sync)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    return bool(_all_finite(leaves)) if leaves else True


@jax.jit
def _all_finite(leaves):
    # one program per tree: leaf by leaf, each shape would be a program (two) of its own to compile
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def check_batch(batch: Batch, config: TrainConfig, step: int) -> None:
    """ValueError unless the batch has batch_size rows of one length L <= seq_length (tokens, loss_mask
    [B, L], lengths [B])."""
    rows, length = np.shape(batch.tokens) if np.ndim(batch.tokens) == 2 else (None, None)
    if (rows != config.batch_size or not 0 < length <= config.seq_length or np.shape(batch.loss_mask) != (rows, length)
            or np.shape(batch.lengths) != (rows,)):
        raise ValueError(f"the batch of step {step} has tokens {np.shape(batch.tokens)}, loss_mask "
                         f"{np.shape(batch.loss_mask)} and lengths {np.shape(batch.lengths)}; the config asks for "
                         f"{config.batch_size} rows (batch_size) of at most {config.seq_length} tokens (seq_length)")


# --- run directory: checkpoints, configuration, history ---

CONFIG_FILE, HISTORY_FILE, PLOT_FILE, CHECKPOINTS = "train_config.json", "history.json", "loss.png", "checkpoints"
CHECKSUMS_FILE = "checkpoint_checksums.json"
RUN_MARKERS = (CONFIG_FILE, CHECKPOINTS)  # what makes a directory a training run's


def run_differences(old: dict, config: TrainConfig, batch_settings: dict | None = None) -> dict[str, tuple]:
    """{key: (stored value, new value)} of what a resume would change in the run `old` (its
    train_config.json): the config's fields but bookkeeping and `steps`, and the batch settings. A config
    field added since the run was written reads as its default (the behaviour that run had); a run written
    before batch settings were recorded has none to compare."""
    new = json.loads(json.dumps(config.to_json()))
    old = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING} | old
    # attention_chunk trades memory for chunks; the loss is the same
    free = {"run_dir", "checkpoint_every", "log_every", "steps", "batches", "attention_chunk"}
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if k not in free and old.get(k) != new.get(k)}
    if batch_settings is not None and "batches" in old:
        settings, stored = json.loads(json.dumps(batch_settings)), old["batches"]
        changed |= {f"batches.{k}": (stored.get(k), settings.get(k)) for k in sorted(set(stored) | set(settings))
                    if stored.get(k) != settings.get(k)}
    return changed


def check_same_run(old: dict, config: TrainConfig, path: Path, batch_settings: dict | None = None) -> None:
    """ValueError naming the fields a resume would change (only bookkeeping and `steps` may differ)."""
    changed = run_differences(old, config, batch_settings)
    if changed:
        raise ValueError(f"cannot resume: the configuration differs from the run's {path} in {sorted(changed)}")


def read_json(path: Path, what: str):
    """The JSON value of `path`; ValueError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} ({what}) cannot be read: {e}; restore it, or remove it and start a new "
                         "run") from None


def check_run_location(run_dir: Path) -> None:
    """ValueError unless `run_dir` is a new or empty directory, or a training run's own: never inside
    another run's tree (its checkpoint rotation or export would delete this one) and never a directory of
    other files (an HF checkpoint, another tool's output)."""
    real_dir = run_dir.resolve()
    for parent in real_dir.parents:
        if any((parent / marker).exists() for marker in RUN_MARKERS):
            raise ValueError(f"run directory {run_dir} (resolved: {real_dir}) is inside the training run {parent}: "
                             "that run's checkpoint rotation and export would delete files of this one; choose a "
                             "directory outside it")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not any((run_dir / m).exists() for m in RUN_MARKERS):
        found = sorted(p.name for p in run_dir.iterdir())
        raise ValueError(f"run directory {run_dir} holds files that are not a training run's ({found[:10]}): "
                         "choose a new or empty directory")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory: its checkpoint manager, configuration, checksums and history."""

    directory: Path

    def open(self, config: TrainConfig, *, resume: bool, batch_settings: dict | None = None):
        """The run's checkpoint manager, after checking the directory against `config` and `resume`."""
        check_run_location(self.directory)
        stored = self.directory / CONFIG_FILE
        latest = self.latest_step()
        if latest is not None:
            if not resume:
                raise ValueError(f"{self.directory} already holds checkpoints (latest step {latest}): pass "
                                 "resume=True (--resume) to continue, or choose another directory")
            if not stored.is_file():
                raise ValueError(f"cannot resume {self.directory}: its {CONFIG_FILE} is missing, so the run's "
                                 "settings cannot be checked against this call's")
            check_same_run(read_json(stored, "the run's configuration"), config, stored, batch_settings)
        self.directory.mkdir(parents=True, exist_ok=True)
        manager = self.manager()
        record = config.to_json() | ({} if batch_settings is None else {"batches": batch_settings})
        write_atomic(stored, json.dumps(record, indent=2) + "\n")
        return manager

    def manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(self.directory.absolute() / CHECKPOINTS,
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def latest_step(self) -> int | None:
        """The latest committed checkpoint's step (None: none), creating nothing."""
        if not (self.directory / CHECKPOINTS).is_dir():
            return None
        with self.manager() as manager:
            return manager.latest_step()

    def save(self, manager: ocp.CheckpointManager, state: TrainState, history: list[dict]) -> None:
        """Checkpoints `state` (refusing a non-finite one: the kept checkpoints stay the last finite ones)
        with its checksums, and writes the history up to it (a killed call keeps its records)."""
        step = int(state.step)
        tree = dataclasses.asdict(state)
        if not all_finite(tree):
            raise Diverged(f"training diverged: the parameters or optimizer state hold NaN or Inf after step "
                           f"{step}; not saved, the last checkpoint is step {manager.latest_step()}")
        # the checksums are recorded before the checkpoint commits: a kill between the two leaves a record of
        # a step that does not exist, never a step without its record
        self.record_files(manager)  # the saves before this one, committed (Orbax waits for them before a new one)
        self.record_checksums(step, tree_checksums(jax.device_get(tree)), keep=manager.all_steps())
        manager.save(step, args=ocp.args.StandardSave(tree))
        self.write_history([r for r in history if r["step"] <= step], plot=False)

    def checksums(self) -> dict:
        """The checksums file: {"steps": {step: array checksums}, "files": {step: {file: [bytes, CRC-32]}}}."""
        path = self.directory / CHECKSUMS_FILE
        return read_json(path, "checkpoint checksums") if path.is_file() else {}

    def write_checksums(self, steps: dict, files: dict) -> None:
        write_atomic(self.directory / CHECKSUMS_FILE, json.dumps({"checksum": "crc32", "chunk_bytes": CHUNK_BYTES,
                                                                  "steps": steps, "files": files}) + "\n")

    def record_checksums(self, step: int, checksums: dict, *, keep) -> None:
        record, kept = self.checksums(), {int(s) for s in keep}
        steps = {s: v for s, v in record.get("steps", {}).items() if int(s) in kept} | {str(step): checksums}
        self.write_checksums(steps, {s: v for s, v in record.get("files", {}).items() if int(s) in kept})

    def record_files(self, manager: ocp.CheckpointManager) -> None:
        """Records each committed checkpoint's files (bytes and CRC-32) once, after waiting for the save in flight:
        `restore` checks them before Orbax reads any (a damaged file then fails by name, not inside Orbax's
        asynchronous reads, whose abandoned tasks print tracebacks as the process exits)."""
        manager.wait_until_finished()
        record = self.checksums()
        files = record.get("files", {})
        new = {}
        for step in manager.all_steps():
            if str(step) not in files:
                where = self.directory / CHECKPOINTS / str(step)
                new[str(step)] = {name: [(where / name).stat().st_size, file_checksum(where / name)]
                                  for name in files_under(where)}
        if new:
            self.write_checksums(record.get("steps", {}), files | new)

    @staticmethod
    def check_files(where: Path, recorded: dict, remedy: str) -> None:
        """ValueError naming the first file of the checkpoint in `where` that is missing or differs from its record
        (`recorded`: {file: [bytes, CRC-32]}; empty for a checkpoint recorded before file records existed, which
        Orbax's reads alone check)."""
        for name, (size, crc) in recorded.items():
            path = where / name
            if not path.is_file():
                raise ValueError(f"checkpoint {where} is damaged: its file {name} is missing; {remedy}")
            if path.stat().st_size != size:
                raise ValueError(f"checkpoint {where} is damaged: its file {name} holds {path.stat().st_size:,} bytes, "
                                 f"{size:,} when it was written (truncated?); {remedy}")
            if file_checksum(path) != crc:
                raise ValueError(f"checkpoint {where} is damaged: the bytes of its file {name} differ from those "
                                 f"written (CRC-32); {remedy}")

    def restore(self, manager: ocp.CheckpointManager, like: TrainState) -> TrainState:
        """The latest checkpoint, restored into the structure, shapes and dtypes of `like`, checked against
        its checksums and for non-finite values."""
        step = manager.latest_step()
        where = self.directory / CHECKPOINTS / str(step)
        remedy = (f"remove {where} to resume from the checkpoint before it, or start a new run")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, dataclasses.asdict(like))
        record = self.checksums()
        self.check_files(where, record.get("files", {}).get(str(step), {}), remedy)
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # Orbax / TensorStore raise many types for a truncated or corrupt file
            said = str(e).splitlines()[0].split(" See full TensorStore details")[0] if str(e) else ""
            raise ValueError(f"checkpoint {where} cannot be read (damaged or truncated: {type(e).__name__}: "
                             f"{said}); {remedy}") from None
        path = self.directory / CHECKSUMS_FILE
        recorded = record.get("steps", {}).get(str(step))
        if recorded is None:
            print(f"warning: {path} records no checksums of step {step} (a run written before they existed): "
                  "its values are checked for NaN/Inf only", file=sys.stderr)
        else:
            found = tree_checksums(jax.device_get(restored))
            bad = sorted(k for k in set(found) | set(recorded) if found.get(k) != recorded.get(k))
            if bad:
                raise ValueError(f"checkpoint {where} is damaged: {len(bad)} arrays differ from the checksums "
                                 f"written with it ({bad[:5]}); {remedy}")
        if not all_finite(restored):
            raise ValueError(f"checkpoint {where} holds NaN or Inf values; {remedy}")
        return TrainState(**restored)

    def read_history(self) -> list[dict]:
        path = self.directory / HISTORY_FILE
        if not path.is_file():
            return []
        history = read_json(path, "the loss history")
        if not (isinstance(history, dict) and isinstance(history.get("steps"), list)):
            raise ValueError(f"{path} (the loss history) is not a {{\"steps\": [...]}} object; restore it, or "
                             "remove it (the resumed run then keeps only the losses from here on)")
        return history["steps"]

    def write_history(self, history: list[dict], *, plot: bool) -> None:
        """history.json and, with plot=True and matplotlib installed, loss.png (a message otherwise)."""
        write_atomic(self.directory / HISTORY_FILE, json.dumps({"steps": history}, indent=1) + "\n")
        if not plot:
            return
        try:
            write_atomic(self.directory / PLOT_FILE, loss_plot_png(history))
        except ImportError:
            print(f"matplotlib is not installed: no loss curve ({self.directory / PLOT_FILE}); the losses are in "
                  f"{self.directory / HISTORY_FILE}")


def loss_plot_png(history: list[dict]) -> bytes:
    """The loss curve as PNG bytes."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], lw=0.8, label="loss (1/t weighted)")
    ax.plot(steps, [r["ce"] for r in history], lw=0.8, label="CE of masked tokens")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


# --- export ---

def hf_tensors(params: dict, model, *, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{HF name: tensor} of float32 checkpoint-layout `params`: the inverse of the converter's name map
    and transforms (`dllm_jax.checkpoint.hf.invert_transform`)."""
    check_param_shapes(params, model)
    target = {"float32": np.float32, "bfloat16": jnp.bfloat16}[dtype]
    tensors = {}
    for rule in rules_for(model):
        stacked = np.asarray(tree_get(params, rule.path), np.float32)
        for layer in (range(model.num_layers) if rule.per_layer else [None]):
            value = invert_transform(rule.transform, stacked if layer is None else stacked[layer])
            tensors[hf_name(rule, layer)] = np.ascontiguousarray(value).astype(target)
    return tensors


def export_hf(params: dict, model_config, directory, tokenizer_dir=None, *, dtype: str = "float32") -> Path:
    """Writes `params` (checkpoint layout) as an HF checkpoint: config.json + model.safetensors in the
    family's own names (what `dllm_jax.load_model` and the converter read), stored as `dtype`
    ("float32" | "bfloat16"), plus the tokenizer files of `tokenizer_dir` (tokenizer.json, ...).

    Each file is replaced atomically. A `model.safetensors.index.json` already in `directory` (an earlier
    sharded checkpoint) is removed with the shard files it names: the loader would read those instead of
    the new weights."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"export dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    side = {}
    if tokenizer_dir is not None:
        side = {name: (Path(tokenizer_dir) / name).read_bytes() for name in SIDE_FILES
                if (Path(tokenizer_dir) / name).is_file()}
        if "tokenizer.json" not in side:
            raise ValueError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json")
    tensors = hf_tensors(params, model_config, dtype=dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_index(directory)
    write_hf_files(directory, model_config.to_hf_config() | {"torch_dtype": dtype}, tensors)
    for name, content in side.items():
        write_atomic(directory / name, content)
    return directory


def remove_stale_index(directory: Path) -> None:
    """Removes `directory`'s safetensors index and the shard files it names inside `directory` (the index
    first: a kill in between leaves shards the loader reports as doubly stored, never read silently)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = {str(v) for v in weight_map.values()} if isinstance(weight_map, dict) else set()
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        shards = set()
    index.unlink()
    for name in sorted(shards):
        shard = directory / name
        if Path(name).name == name and name.endswith(".safetensors") and name != "model.safetensors" \
                and shard.is_file():
            shard.unlink()
    print(f"export: removed the stale {index} and its {len(shards)} shard files", file=sys.stderr)
