"""The training loop: optax AdamW, one jitted step, checkpoints and resume through the run directory
(`dllm_jax.train.run_folder`); trained weights leave as an HF checkpoint through `dllm_jax.train.export`.

Parameters are trained in the checkpoint layout of dllm_jax.models.layers (stacked layers, one tensor
per projection; what the HF name maps convert to and from) and kept in float32; the forward runs in
`compute_dtype` (mixed precision: the loss casts the float32 master weights, so gradients and optimizer
state stay float32). A non-finite loss or state stops the run before it is saved (`Diverged`), so the kept
checkpoints are always finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from dllm_jax.train.data import Batch, Prefetcher
from dllm_jax.train.losses import LossMetrics, llada_logits, llada_loss, sdar_loss
from dllm_jax.train.run_folder import CHECKPOINTS, Diverged, Run
from dllm_jax.train.state import StepMetrics, TrainConfig, TrainResult, TrainState
from dllm_jax.train.surgery import check_param_shapes, init_params
from dllm_jax.validation import integer, real

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


def check_batch(batch: Batch, config: TrainConfig, step: int) -> None:
    """ValueError unless the batch has batch_size rows of one length L <= seq_length (tokens, loss_mask
    [B, L], lengths [B])."""
    rows, length = np.shape(batch.tokens) if np.ndim(batch.tokens) == 2 else (None, None)
    if (rows != config.batch_size or not 0 < length <= config.seq_length or np.shape(batch.loss_mask) != (rows, length)
            or np.shape(batch.lengths) != (rows,)):
        raise ValueError(f"the batch of step {step} has tokens {np.shape(batch.tokens)}, loss_mask "
                         f"{np.shape(batch.loss_mask)} and lengths {np.shape(batch.lengths)}; the config asks for "
                         f"{config.batch_size} rows (batch_size) of at most {config.seq_length} tokens (seq_length)")
