"""The training loop: optax AdamW, one jitted step, Orbax checkpoint/resume, loss history and plot,
and the export of trained weights as an HF checkpoint `dllm_jax.load_model` reads.

Parameters are trained in the checkpoint layout of dllm_jax.models.layers (stacked layers, one tensor
per projection; what the HF name maps convert to and from) and kept in float32; the forward runs in
`compute_dtype` (mixed precision: the loss casts the float32 master weights, so gradients and optimizer
state stay float32).

A run directory holds:
  checkpoints/<step>/   Orbax (CheckpointManager) trees of {params, opt_state, step, rng}
  train_config.json     the run's configuration (a resume must match it)
  history.json          the per-step loss record
  loss.png              the loss curve (when matplotlib is installed)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
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
from dllm_jax.checkpoint.orbax import tree_paths
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.models import llada
from dllm_jax.models.layers import lm_param_shapes
from dllm_jax.testing import write_hf_checkpoint
from dllm_jax.train.data import Batch, Prefetcher
from dllm_jax.train.losses import LossMetrics, llada_loss, sdar_loss
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
    instead of iid.
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
    run_dir: str | None = None
    checkpoint_every: int = 0
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.model, tuple(FAMILIES.values())):
            raise ValueError(f"TrainConfig.model must be an LLaDAConfig or SDARConfig, got {type(self.model).__name__}")
        for name in ("steps", "batch_size", "seq_length", "log_every"):
            object.__setattr__(self, name, integer(f"TrainConfig.{name}", getattr(self, name)))
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
            real = jnp.arange(tokens.shape[1]) < lengths[:, None]

            def llada_logits(params, ids):
                return llada.forward(params, ids, real, config=model, padding="mask")[0]

            return llada_loss(llada_logits, params, tokens, loss_mask, key, mask_token_id=model.mask_token_id,
                              eps=config.eps, stratified=config.stratified_t)
        return sdar_loss(params, tokens, loss_mask, key, config=model, eps=config.eps, stratified=config.stratified_t)

    return loss


def initial_state(config: TrainConfig, params: dict | None = None) -> TrainState:
    """Step 0: `params` (copied to float32, checked against the model's shapes) or fresh ones."""
    init_key, rng = jax.random.split(jax.random.PRNGKey(config.seed))
    if params is None:
        params = init_params(config.model, init_key)
    else:
        check_param_shapes(params, config.model)
        params = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)  # the step donates its state
    return TrainState(params=params, opt_state=optimizer(config).init(params), step=jnp.zeros((), jnp.int32), rng=rng)


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
          data_workers: int = 0) -> TrainResult:
    """Trains from step 0 (or the latest checkpoint of `config.run_dir` with resume=True) up to
    `config.steps`, or only up to `stop_at` (a partial run of the same schedule, to resume later).

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
    Returns:
      TrainResult with the final state (checkpointed to run_dir if set) and the per-step loss history.
    """
    end = config.steps if stop_at is None else integer("stop_at", stop_at, maximum=config.steps)
    run_dir = None if config.run_dir is None else Path(config.run_dir)
    state, history = initial_state(config, params), []
    manager = None if run_dir is None else open_run(run_dir, config, resume=resume)
    try:
        if manager is not None and manager.latest_step() is not None:
            state = restore_state(manager, state)
            history = [r for r in read_history(run_dir) if r["step"] <= int(state.step)]
        deadline = None if max_seconds is None else time.monotonic() + real("max_seconds", max_seconds, low=0)
        with contextlib.ExitStack() as stack:
            if integer("data_workers", data_workers, minimum=0):
                batches = stack.enter_context(Prefetcher(batches, data_workers))
            state, records = run_steps(config, batches, state, end=end, manager=manager, progress=progress,
                                       deadline=deadline)
        history += records
        if manager is not None:
            if manager.latest_step() != int(state.step):
                save_state(manager, state)
            manager.wait_until_finished()
            write_history(run_dir, history)
    finally:
        if manager is not None:
            manager.close()
    return TrainResult(state=state, history=tuple(history))


def run_steps(config: TrainConfig, batches, state: TrainState, *, end: int, manager, progress: bool,
              deadline: float | None = None) -> tuple[TrainState, list[dict]]:
    """Steps state.step..end-1, or fewer if time.monotonic() passes `deadline`: (final state, their
    history records). Metrics are fetched from the device only every log_every steps (no per-step host
    sync), and at the last step."""
    jit_config, start = step_config(config), int(state.step)
    records, pending = [], []
    bar = tqdm(total=config.steps, initial=start, desc=f"train {config.family}", unit="step", disable=not progress)
    clock, tokens_since = time.perf_counter(), 0
    for step in range(start, end):
        batch = batches(step)
        check_batch(batch, config, step)
        state, metrics = train_step(state, jnp.asarray(batch.tokens), jnp.asarray(batch.loss_mask),
                                    jnp.asarray(batch.lengths), config=jit_config)
        pending.append((step + 1, metrics))
        tokens_since += batch.tokens.size
        last = step + 1 == end or (deadline is not None and time.monotonic() > deadline)
        if (step + 1) % config.log_every == 0 or last:
            fetched = jax.device_get([m for _, m in pending])
            records += [{"step": s, "loss": float(m.loss), "ce": float(m.ce), "grad_norm": float(m.grad_norm),
                         "learning_rate": float(m.learning_rate)} for (s, _), m in zip(pending, fetched)]
            now = time.perf_counter()
            bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", tok_s=f"{tokens_since / (now - clock):.0f}")
            bar.update(len(pending))
            pending, clock, tokens_since = [], now, 0
        if manager is not None and config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            save_state(manager, state)
        if last:
            break
    bar.close()
    return state, records


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


def open_run(run_dir: Path, config: TrainConfig, *, resume: bool) -> ocp.CheckpointManager:
    """The run's checkpoint manager, after checking the directory against `config` and `resume`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(run_dir.absolute() / CHECKPOINTS, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True))
    stored = run_dir / CONFIG_FILE
    if manager.latest_step() is not None:
        if not resume:
            manager.close()
            raise ValueError(f"{run_dir} already holds checkpoints (latest step {manager.latest_step()}): pass "
                             "resume=True (--resume) to continue, or choose another directory")
        if stored.is_file():
            check_same_run(json.loads(stored.read_text()), config, stored)
    stored.write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return manager


def check_same_run(old: dict, config: TrainConfig, path: Path) -> None:
    """ValueError naming the fields a resume would change (only bookkeeping and `steps` may differ)."""
    new = json.loads(json.dumps(config.to_json()))
    # a field added since the run was written reads as its default (the behaviour that run had)
    old = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING} | old
    free = {"run_dir", "checkpoint_every", "log_every", "steps"}
    changed = sorted(k for k in set(old) | set(new) if k not in free and old.get(k) != new.get(k))
    if changed:
        raise ValueError(f"cannot resume: the configuration differs from the run's {path} in {changed}")


def save_state(manager: ocp.CheckpointManager, state: TrainState) -> None:
    manager.save(int(state.step), args=ocp.args.StandardSave(dataclasses.asdict(state)))


def restore_state(manager: ocp.CheckpointManager, like: TrainState) -> TrainState:
    """The latest checkpoint, restored into the structure, shapes and dtypes of `like`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, dataclasses.asdict(like))
    restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    return TrainState(**restored)


def read_history(run_dir: Path) -> list[dict]:
    path = run_dir / HISTORY_FILE
    return json.loads(path.read_text())["steps"] if path.is_file() else []


def write_history(run_dir: Path, history: list[dict]) -> None:
    """history.json and, when matplotlib is installed, loss.png (a message otherwise)."""
    (run_dir / HISTORY_FILE).write_text(json.dumps({"steps": history}, indent=1) + "\n")
    try:
        plot_losses(history, run_dir / PLOT_FILE)
    except ImportError:
        print(f"matplotlib is not installed: no loss curve ({run_dir / PLOT_FILE}); the losses are in "
              f"{run_dir / HISTORY_FILE}")


def plot_losses(history: list[dict], path: Path) -> None:
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
    fig.savefig(path, dpi=120)


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
    ("float32" | "bfloat16"), plus the tokenizer files of `tokenizer_dir` (tokenizer.json, ...)."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"export dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    directory = write_hf_checkpoint(directory, model_config, dtype=dtype,
                                    tensors=hf_tensors(params, model_config, dtype=dtype))
    if tokenizer_dir is not None:
        copied = [name for name in SIDE_FILES if (Path(tokenizer_dir) / name).is_file()]
        if "tokenizer.json" not in copied:
            raise ValueError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json")
        for name in copied:
            shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory
