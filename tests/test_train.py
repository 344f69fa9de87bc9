"""dllm_jax.train on CPU with tiny models: the losses, the two-copy mask, packing, training, resume, export."""

import collections
import dataclasses
import functools
import json
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.models import llada, sdar
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config
from dllm_jax.train import (Batch, BatchSource, TrainConfig, export_hf, init_params, llada_loss, pack, sdar_loss,
                            train, two_copy_mask)
from dllm_jax.train.__main__ import build_parser, model_config
from dllm_jax.train.task_batches import TaskSampler, batch_source, room_for
from dllm_jax.train.__main__ import main as train_main
from dllm_jax.train.data import BucketedSource, Prefetcher
from dllm_jax.train.loop import loss_fn
from dllm_jax.train.run_folder import check_same_run
from dllm_jax.train.surgery import grow_layers, regroup_heads, widen_heads
from dllm_jax.train.losses import block_ratios, mask_tokens, row_ratios, two_copy_logits

LLADA = tiny_llada_config(vocab_size=64, tokenizer_vocab_size=64, mask_token_id=60, eos_token_id=61, pad_token_id=61,
                          eot_token_id=62)
SDAR = tiny_sdar_config(vocab_size=64, mask_token_id=60, eos_token_ids=(61,), pad_token_id=61)
STEPS, RESUME_AT = 30, 20


def llada_logits(params, ids):
    return llada.forward(params, ids, config=LLADA)[0]


def fixed_batch(rng, batch=4, length=16, vocab=48) -> Batch:
    """Rows that repeat a random 4-token motif: a masked token is predictable from the others."""
    tokens = np.tile(rng.integers(0, vocab, (batch, 4)), (1, length // 4)).astype(np.int32)
    return Batch(tokens=tokens, loss_mask=np.ones((batch, length), bool), lengths=np.full(batch, length, np.int32))


def run_config(model, **overrides) -> TrainConfig:
    values = dict(model=model, steps=STEPS, batch_size=4, seq_length=16, learning_rate=1e-2, warmup_steps=2,
                  compute_dtype="float32", log_every=10)
    return TrainConfig(**(values | overrides))


@functools.cache
def trained(family: str):
    """One uninterrupted run per family on a fixed batch (shared by the tests that read a trained model)."""
    model, dtype = (LLADA, "float32") if family == "llada" else (SDAR, "bfloat16")
    batch = fixed_batch(np.random.default_rng(7))
    return batch, train(run_config(model, compute_dtype=dtype), lambda step: batch, progress=False)


def test_pack_lays_out_prompt_answer_and_padding():
    samples = [types.SimpleNamespace(prompt_ids=np.array([5, 6, 7]), answer_ids=np.array([8, 2])),
               types.SimpleNamespace(prompt_ids=np.array([9]), answer_ids=np.array([3, 4, 2]))]
    batch = pack(samples, 7, pad_id=0)
    np.testing.assert_array_equal(batch.tokens, [[5, 6, 7, 8, 2, 0, 0], [9, 3, 4, 2, 0, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch.lengths, [5, 4])
    assert batch.tokens.dtype == np.int32
    roomy = pack(samples, 7, pad_id=0, answer_room=[3, 4])  # the window is padded, in the loss, and real
    np.testing.assert_array_equal(roomy.tokens, batch.tokens)
    np.testing.assert_array_equal(roomy.loss_mask, [[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(roomy.lengths, [6, 5])
    with pytest.raises(ValueError, match="more than the sequence length 4"):
        pack(samples, 4, pad_id=0)
    with pytest.raises(ValueError, match="answer_room 2 is shorter than its 3 answer tokens"):
        pack(samples, 7, pad_id=0, answer_room=[3, 2])


def test_batch_source_is_a_function_of_seed_and_step(rng):
    def sample_fn(seed, count):
        r = np.random.default_rng(seed)
        return [types.SimpleNamespace(prompt_ids=r.integers(3, 50, 5), answer_ids=r.integers(3, 50, 2))
                for _ in range(count)]

    source = BatchSource(sample_fn, batch_size=3, length=8, pad_id=0, seed=int(rng.integers(1000)))
    first = [b.tokens for b, _ in zip(source, range(3))]
    np.testing.assert_array_equal(source(2).tokens, first[2])
    assert not np.array_equal(first[0], first[1])
    assert not np.array_equal(source(0).tokens, dataclasses.replace(source, seed=source.seed + 1)(0).tokens)


def test_masking_follows_t_and_loss_mask(rng):
    b, n = 6, 4000
    tokens = jnp.asarray(rng.integers(0, 50, (b, n)), jnp.int32)
    loss_mask = jnp.asarray(rng.random((b, n)) < 0.7)
    t = jnp.broadcast_to(jnp.asarray([0.01, 0.1, 0.3, 0.5, 0.8, 0.99])[:, None], (b, n))
    noised = mask_tokens(tokens, loss_mask, t, jax.random.PRNGKey(int(rng.integers(1 << 30))), mask_token_id=60)
    masked, eligible = np.asarray(noised.masked), np.asarray(loss_mask)
    assert not (masked & ~eligible).any()
    np.testing.assert_array_equal(np.asarray(noised.tokens), np.where(masked, 60, np.asarray(tokens)))
    fraction = masked.sum(1) / eligible.sum(1)
    p = np.asarray(t[:, 0])
    assert np.all(np.abs(fraction - p) < 5 * np.sqrt(p * (1 - p) / eligible.sum(1)))


def test_block_ratios_are_constant_per_block_and_in_range(rng):
    t = np.asarray(block_ratios(jax.random.PRNGKey(int(rng.integers(1 << 30))), 3, 18, block_size=4, eps=0.1))
    assert t.shape == (3, 18) and (t >= 0.1).all() and (t < 1).all()
    for start in range(0, 18, 4):
        assert (t[:, start:start + 4] == t[:, start:start + 1]).all()
    assert len(np.unique(t)) == 3 * 5  # every block of every row draws its own t


def test_default_ratios_are_the_iid_draws_of_the_key(rng):
    """stratified=False keeps the iid numerics: t = eps + (1 - eps) * uniform(key) per row or block."""
    key, eps = jax.random.PRNGKey(int(rng.integers(1 << 30))), 0.05
    u_rows = np.asarray(jax.random.uniform(key, (5, 1)))
    np.testing.assert_array_equal(np.asarray(row_ratios(key, 5, 7, eps=eps)),
                                  np.repeat(np.float32(eps) + np.float32(1 - eps) * u_rows, 7, axis=1))
    u_blocks = np.asarray(jax.random.uniform(key, (3, 5)))  # 18 positions: 5 blocks of 4, the last partial
    np.testing.assert_array_equal(np.asarray(block_ratios(key, 3, 18, block_size=4, eps=eps)),
                                  np.repeat(np.float32(eps) + np.float32(1 - eps) * u_blocks, 4, axis=1)[:, :18])


@pytest.mark.parametrize("eps", [1e-3, 0.2])
def test_stratified_ratios_put_one_t_in_each_1_over_n_of_the_range(eps, rng):
    for trial in range(5):
        key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
        rows = np.asarray(row_ratios(key, 8, 6, eps=eps, stratified=True), np.float64)
        assert (rows == rows[:, :1]).all()
        blocks = np.asarray(block_ratios(key, 3, 18, block_size=4, eps=eps, stratified=True), np.float64)
        for start in range(0, 18, 4):
            assert (blocks[:, start:start + 4] == blocks[:, start:start + 1]).all()
        for t in (rows[:, 0], blocks[:, ::4].reshape(-1)):  # the 8 rows' t; the 3 * 5 blocks' t
            n = t.size
            assert (t >= eps).all() and (t < 1).all()
            cells = np.floor((t - eps) / (1 - eps) * n).astype(int)
            np.testing.assert_array_equal(np.sort(cells), np.arange(n))  # each [eps + (1-eps) k/n, ...) once
    orders = {tuple(np.argsort(np.asarray(row_ratios(jax.random.PRNGKey(s), 8, 1, eps=eps, stratified=True))[:, 0]))
              for s in range(4)}
    assert len(orders) > 1  # the intervals go to the rows in a random order


def test_stratified_t_reaches_the_loss(rng):
    params, tokens, loss_mask, key = loss_inputs(rng, "llada")
    lengths = jnp.full(8, 32, jnp.int32)
    plain, stratified = (jax.jit(loss_fn(run_config(LLADA, compute_dtype="float32", stratified_t=s)))(
        params, tokens, loss_mask, lengths, key)[0] for s in (False, True))
    assert np.isfinite(float(stratified)) and float(stratified) != float(plain)
    with pytest.raises(ValueError, match="stratified_t must be True or False"):
        run_config(LLADA, stratified_t=1)


def test_two_copy_mask_is_block_causal_as_specified():
    for length, bs in ((8, 4), (6, 2), (7, 3), (5, 1)):
        mask = np.asarray(two_copy_mask(length, bs))
        want = np.zeros((2 * length, 2 * length), bool)
        for q in range(2 * length):
            for k in range(2 * length):
                bq, bk = (q % length) // bs, (k % length) // bs
                if q < length:
                    want[q, k] = bk == bq if k < length else bk < bq
                else:
                    want[q, k] = k >= length and bk <= bq
        np.testing.assert_array_equal(mask, want, err_msg=f"{length=} {bs=}")


@functools.cache
def jitted_loss(family: str):
    if family == "llada":
        return jax.jit(functools.partial(llada_loss, llada_logits, mask_token_id=LLADA.mask_token_id))
    return jax.jit(functools.partial(sdar_loss, config=SDAR))


def loss_inputs(rng, family: str):
    params = init_params(LLADA if family == "llada" else SDAR, jax.random.PRNGKey(int(rng.integers(1 << 30))))
    tokens = jnp.asarray(rng.integers(0, 48, (8, 32)), jnp.int32)
    loss_mask = jnp.asarray(rng.random((8, 32)) < 0.8)
    return params, tokens, loss_mask, jax.random.PRNGKey(int(rng.integers(1 << 30)))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_training_loss_never_sees_the_padding(family, rng):
    """What follows a row's real tokens (its length) changes neither the loss nor its gradient: LLaDA
    masks those keys, SDAR's block-causal attention never looks past the block (lengths in whole blocks)."""
    params, tokens, loss_mask, key = loss_inputs(rng, family)
    lengths = rng.integers(12, 33, 8)
    if family == "sdar":
        lengths = lengths // SDAR.block_size * SDAR.block_size
    lengths = jnp.asarray(lengths, jnp.int32)
    real = jnp.arange(32) < lengths[:, None]
    loss_mask = loss_mask & real
    other = jnp.where(real, tokens, jnp.asarray(rng.integers(0, 48, (8, 32)), jnp.int32))
    grad = jax.jit(jax.value_and_grad(loss_fn(run_config(LLADA if family == "llada" else SDAR,
                                                         compute_dtype="float32")), has_aux=True))
    (loss, _), g = grad(params, tokens, loss_mask, lengths, key)
    (loss_other, _), g_other = grad(params, other, loss_mask, lengths, key)
    np.testing.assert_allclose(loss_other, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_other, g)


def test_max_seconds_stops_after_the_step_that_passes_it():
    batch, _ = trained("llada")
    result = train(run_config(LLADA), lambda step: batch, max_seconds=0, progress=False)
    assert int(result.state.step) == 1 and [r["step"] for r in result.history] == [1]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_loss_at_init_is_about_log_vocab(family, rng):
    params, tokens, loss_mask, key = inputs = loss_inputs(rng, family)
    loss, metrics = jitted_loss(family)(*inputs)
    log_v = math.log(LLADA.vocab_size if family == "llada" else SDAR.vocab_size)
    assert np.isfinite(float(loss))
    assert abs(float(metrics.ce) - log_v) < 0.05  # N(0, 0.02) weights: logits near 0, CE = log V
    assert 0 < int(metrics.masked) <= int(metrics.eligible) == int(loss_mask.sum())
    # E[loss] = E[CE] = log V; one draw is CE * (masked / eligible) / t averaged over 8 rows
    assert 0.3 * log_v < float(loss) < 3 * log_v


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_loss_normalisation_matches_the_documented_formula(family, rng):
    params, tokens, loss_mask, key = inputs = loss_inputs(rng, family)
    loss, _ = jitted_loss(family)(*inputs)
    # redo the draws (the key split of the losses) and sum by hand
    t_key, mask_key = jax.random.split(key)
    if family == "llada":
        t = 1e-3 + (1 - 1e-3) * np.repeat(np.asarray(jax.random.uniform(t_key, (8, 1))), 32, axis=1)
    else:
        t = 1e-3 + (1 - 1e-3) * np.repeat(np.asarray(jax.random.uniform(t_key, (8, 8))), 4, axis=1)
    masked = (np.asarray(jax.random.uniform(mask_key, (8, 32))) < t) & np.asarray(loss_mask)
    noisy = jnp.where(masked, 60, tokens)
    if family == "llada":
        logits = llada_logits(params, noisy)
    else:
        logits = two_copy_logits(params, noisy, tokens, config=SDAR)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    eligible = np.asarray(loss_mask).sum(1)
    want = np.mean([(ce[b] * masked[b] / t[b]).sum() / max(1, eligible[b]) for b in range(8)])
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


def test_two_copy_logits_equal_block_causal_forward_of_clean_prefix(rng):
    """Noisy block b sees what SDAR's own forward shows block b of (clean blocks < b) ++ (noisy block b)."""
    params = init_params(SDAR, jax.random.PRNGKey(int(rng.integers(1 << 30))))
    params = jax.tree.map(lambda p: p * 20 if p.ndim > 1 else p, params)  # large weights: attention is not uniform
    clean = jnp.asarray(rng.integers(0, 60, (2, 12)), jnp.int32)
    noisy = jnp.where(jnp.asarray(rng.random((2, 12)) < 0.5), 60, clean)
    got = np.asarray(two_copy_logits(params, noisy, clean, config=SDAR))
    forward = jax.jit(lambda ids: sdar.forward(params, ids, config=SDAR)[0])
    for block in range(3):
        cols = slice(4 * block, 4 * block + 4)
        mixed = clean.at[:, cols].set(noisy[:, cols])  # later blocks never reach block `block`
        np.testing.assert_allclose(got[:, cols], np.asarray(forward(mixed))[:, cols], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_training_lowers_the_loss(family):
    """30 steps on one fixed batch (LLaDA in float32, SDAR in bfloat16 compute with float32 master weights)."""
    _, result = trained(family)
    assert len(result.history) == STEPS and int(result.state.step) == STEPS
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(result.params))

    # one step's loss is noisy (1/t weights, one t per row or block): compare the first and last ten steps
    losses, ce = result.losses, np.array([r["ce"] for r in result.history])
    assert losses[-10:].mean() < 0.8 * losses[:10].mean(), losses
    assert ce[-10:].mean() < 0.8 * ce[:10].mean(), ce


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    batch, whole = trained("llada")
    config = run_config(LLADA, run_dir=str(tmp_path / "run"))
    first = train(config, lambda step: batch, stop_at=RESUME_AT, progress=False)
    assert int(first.state.step) == RESUME_AT and (tmp_path / "run" / "history.json").is_file()
    with pytest.raises(ValueError, match="resume=True"):
        train(config, lambda step: batch, progress=False)
    resumed = train(config, lambda step: batch, resume=True, progress=False)
    assert int(resumed.state.step) == STEPS
    assert [r["step"] for r in resumed.history] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), resumed.params, whole.params)
    with pytest.raises(ValueError, match="learning_rate"):
        train(dataclasses.replace(config, learning_rate=5e-3), lambda step: batch, resume=True, progress=False)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_export_hf_loads_with_the_trained_logits(family, tmp_path):
    batch, result = trained(family)
    model = LLADA if family == "llada" else SDAR
    directory = export_hf(result.params, model, tmp_path / "hf")
    loaded = load_model(directory, dtype="float32", progress=False)
    assert loaded.config == model
    forward = llada.forward if family == "llada" else sdar.forward
    want = forward(result.params, jnp.asarray(batch.tokens), config=model)[0]
    np.testing.assert_allclose(np.asarray(loaded(batch.tokens)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_train_config_and_command_line_refuse_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="warmup_steps=5 must be below steps=5"):
        run_config(LLADA, steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match="compute_dtype"):
        run_config(LLADA, compute_dtype="float16")
    with pytest.raises(ValueError, match=r"asks for 4 rows \(batch_size\) of at most 16 tokens"):
        train(run_config(LLADA, steps=2, warmup_steps=0), lambda step: fixed_batch(np.random.default_rng(0), 2),
              progress=False)
    with pytest.raises(ValueError, match=r"tokens \(4, 20\).*at most 16 tokens"):
        train(run_config(LLADA, steps=2, warmup_steps=0),
              lambda step: fixed_batch(np.random.default_rng(0), 4, length=20), progress=False)
    assert train_main(["--family", "llada", "--task", "nope", "--steps", "3", "--out", str(tmp_path)]) == 2
    assert "unknown task" in capsys.readouterr().err


def test_command_line_starts_from_a_checkpoints_weights(tmp_path, capsys):
    """--init: the run starts from the given HF checkpoint (one step at the warm-up's zero learning rate
    leaves its weights exactly as they were, its RoPE base included) and refuses one of the other family."""
    from safetensors.numpy import load_file

    common = ["--task", "sanity", "--context", "64", "--batch", "2", "--warmup", "1", "--no-progress"]
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--stratified-t", "--rope-theta", "1e4",
                       "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["stratified_t"] is True
    first = tmp_path / "a" / "hf"
    assert json.loads((first / "config.json").read_text())["rope_theta"] == 10000.0
    # the first run's seed (0) is the default: its samples again, refused unless --seed says so
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--init", str(first),
                       "--out", str(tmp_path / "b")]) == 2
    assert "comes from a run with seed 0" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--stop-at", "1", "--seed", "1",
                       "--init", str(first), "--out", str(tmp_path / "b")]) == 0
    before, after = load_file(first / "model.safetensors"), load_file(tmp_path / "b" / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert json.loads((tmp_path / "b" / "hf" / "config.json").read_text())["rope_theta"] == 10000.0
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    assert train_main(["--family", "llada", *common, "--steps", "3", "--init", str(first), "--seed", "1",
                       "--out", str(tmp_path / "c")]) == 2
    assert "holds a sdar model" in capsys.readouterr().err
    # --grow-layers, --widen-heads, --max-positions: twice as deep, heads twice as wide, a longer context, and
    # (still at the zero learning rate) the checkpoint's function up to the q/k norms' eps
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--stop-at", "1", "--seed", "1",
                       "--init", str(first),
                       "--grow-layers", "4", "--widen-heads", "64", "--max-positions", "8192",
                       "--out", str(tmp_path / "d")]) == 0
    small, grown = load_model(first, dtype="float32"), load_model(tmp_path / "d" / "hf", dtype="float32")
    assert (small.config.num_layers, small.config.head_dim, small.config.max_position_embeddings) == (2, 32, 4096)
    assert (grown.config.num_layers, grown.config.head_dim, grown.config.max_position_embeddings) == (4, 64, 8192)
    ids = np.arange(3, 19).reshape(1, 16)
    np.testing.assert_allclose(np.asarray(grown(ids)), np.asarray(small(ids)), rtol=1e-4, atol=1e-4)
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--grow-layers", "4",
                       "--out", str(tmp_path / "e")]) == 2
    assert "--grow-layers changes the model of an --init checkpoint" in capsys.readouterr().err
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--init", str(first), "--seed", "1",
                       "--max-positions", "32", "--out", str(tmp_path / "e")]) == 2
    assert re.search(r"allows 32 positions; the run needs \d+", capsys.readouterr().err)
    # --rope-theta with --init: the checkpoint's base replaced (a warm start for longer contexts)
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--stop-at", "1", "--init", str(first),
                       "--seed", "1", "--rope-theta", "1e5", "--out", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / "hf" / "config.json").read_text())["rope_theta"] == 1e5
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--init", str(first), "--seed", "1",
                       "--rope-theta", "0.5", "--out", str(tmp_path / "f2")]) == 2
    assert "rope_theta must be > 1" in capsys.readouterr().err
    assert train_main(["--family", "sdar", *common, "--steps", "3", "--rope-theta", "1",
                       "--out", str(tmp_path / "g")]) == 2
    assert "rope_theta must be > 1" in capsys.readouterr().err


def bucketed_source(family: str, seed: int = 0) -> BucketedSource:
    args = build_parser().parse_args(["--family", family, "--task", "passkey,sanity", "--context", "64,256",
                                      "--batch", "4", "--steps", "30", "--seed", str(seed), "--out", "unused"])
    from dllm_jax.eval import build_tokenizer

    return batch_source(args, build_tokenizer())


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_batches_are_bucketed_by_context(family):
    """Each step's batch holds samples of one context (its prompts all start the loss at that context;
    sanity's prompt stays short), packed to that context's bucket (a multiple of 8), not to the longest one."""
    source = bucketed_source(family)
    room = {t: room_for(t, family) for t in ("passkey", "sanity")}
    sanity_prompt = 64  # dllm_jax.eval.tasks: sanity prompts are min(context, 64) tokens
    even = lambda n: -(-n // 8) * 8  # buckets are rounded up to multiples of 8 (cuDNN trains on even lengths)
    want = {64: even(max(64 + room["passkey"], sanity_prompt + room["sanity"])),
            256: even(max(256 + room["passkey"], sanity_prompt + room["sanity"]))}
    seen = set()
    for step in range(16):
        batch, context = source(step), source.context(step)
        seen.add(context)
        assert batch.shape == (4, want[context])
        assert (batch.lengths <= batch.shape[1]).all()
        starts = batch.loss_mask.argmax(axis=1)  # where each answer (and the loss) starts: the prompt length
        is_sanity = batch.lengths - starts == room["sanity"]
        np.testing.assert_array_equal(starts, np.where(is_sanity, sanity_prompt, context))
        np.testing.assert_array_equal(source(step).tokens, batch.tokens)  # the same step, the same batch
        np.testing.assert_array_equal(bucketed_source(family)(step).loss_mask, batch.loss_mask)
    assert seen == {64, 256} and source.length == want[256]
    other = bucketed_source(family, seed=1)
    assert any(not np.array_equal(other(step).tokens[:, :64], source(step).tokens[:, :64]) for step in range(4))
    with pytest.raises(ValueError, match=r"no bucket length for the context\(s\) \[256\]"):
        BucketedSource(lambda seed, count, c: [], batch_size=2, contexts=[64, 256], lengths={64: 70}, pad_id=0)


def test_training_over_two_buckets_lowers_the_loss():
    """A tiny LLaDA on passkey/sanity batches of two lengths: one step function for both, the loss drops."""
    from dllm_jax.eval import build_tokenizer, vocab

    source, tokenizer = bucketed_source("llada"), build_tokenizer()
    model = model_config("llada", "tiny", vocab_size=tokenizer.get_vocab_size(), special=vocab.special_ids(tokenizer),
                         max_positions=512)
    batches = {}
    config = run_config(model, steps=20, seq_length=source.length, stratified_t=True)
    result = train(config, lambda step: batches.setdefault(step, source(step)), progress=False)
    lengths = {batch.shape[1] for batch in batches.values()}
    assert len(batches) == 20 and len(lengths) == 2 and max(lengths) == config.seq_length
    losses = result.losses
    assert np.isfinite(losses).all() and losses[-10:].mean() < 0.8 * losses[:10].mean(), losses


@pytest.mark.parametrize("size", ["small-64", "medium-64"])
def test_sizes_of_64_wide_heads_give_both_families_heads_of_64(size):
    """The long-context sizes: 4 query / 2 KV heads of 64 for LLaDA (head_dim = hidden / heads) and SDAR alike;
    the 8-head sizes keep SDAR's heads of 32, as the shipped models have."""
    from dllm_jax.eval import SPECIAL_IDS

    for family in ("llada", "sdar"):
        config = model_config(family, size, vocab_size=512, special=SPECIAL_IDS, max_positions=32768)
        shape = (config.head_dim, config.num_heads, config.num_kv_heads, config.max_position_embeddings)
        assert shape == (64, 4, 2, 32768), (family, shape)
    assert model_config("sdar", "medium", vocab_size=512, special=SPECIAL_IDS, max_positions=4096).head_dim == 32


def test_resume_accepts_a_run_written_before_a_config_field_existed(tmp_path):
    config = run_config(LLADA)
    old = json.loads(json.dumps(config.to_json()))
    del old["stratified_t"]
    check_same_run(old, config, tmp_path / "train_config.json")  # read as the default: the same run
    with pytest.raises(ValueError, match="stratified_t"):
        check_same_run(old, dataclasses.replace(config, stratified_t=True), tmp_path / "train_config.json")


def test_prefetched_batches_are_the_sources_batches():
    """Prefetcher: the command line's batch source, built ahead in a background process, gives the batch
    of every step exactly, also when the steps jump (a restart of the read-ahead)."""
    source = bucketed_source("sdar")
    with Prefetcher(source, workers=1, ahead=3) as prefetched:
        for step in (0, 1, 2, 3, 4, 9, 10, 2):
            got, want = prefetched(step), source(step)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
            np.testing.assert_array_equal(got.lengths, want.lengths)


def test_prefetcher_raises_the_workers_error():
    """A batch that cannot be built raises its ValueError where the loop asks for it, not a broken pool."""
    from dllm_jax.eval import build_tokenizer

    source = BucketedSource(TaskSampler(("niah_multikey",), build_tokenizer()), batch_size=2, contexts=[16],
                            lengths={16: 32}, pad_id=0)
    with Prefetcher(source, workers=1) as prefetched, pytest.raises(ValueError, match="too short for niah_multikey"):
        prefetched(0)


def test_command_line_min_t_sets_the_masking_floor(tmp_path):
    out = tmp_path / "run"
    assert train_main(["--family", "llada", "--task", "passkey", "--context", "64", "--batch", "2", "--steps", "2",
                       "--warmup", "0", "--min-t", "0.4", "--data-workers", "0", "--no-progress",
                       "--out", str(out)]) == 0
    assert json.loads((out / "train_config.json").read_text())["eps"] == 0.4


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_grown_model_computes_what_the_trained_one_did(family, rng):
    """grow_layers: twice the layers, each trained layer followed by a copy of its weights with zero output
    projections: the same logits (float32); a depth that is not a multiple is refused."""
    model = tiny_llada_config() if family == "llada" else tiny_sdar_config()
    params = init_params(model, jax.random.PRNGKey(3))
    grown = grow_layers(params, 2 * model.num_layers)
    deeper = dataclasses.replace(model, num_layers=2 * model.num_layers)
    ids = jnp.asarray(rng.integers(3, model.vocab_size, (2, 12)))
    forward = llada.forward if family == "llada" else sdar.forward
    np.testing.assert_allclose(np.asarray(forward(grown, ids, config=deeper)[0]),
                               np.asarray(forward(params, ids, config=model)[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(grown["layers"]["q_proj"][1], params["layers"]["q_proj"][0])
    assert not np.any(grown["layers"]["o_proj"][1]) and np.array_equal(grown["layers"]["o_proj"][2],
                                                                         params["layers"]["o_proj"][1])
    with pytest.raises(ValueError, match="not a multiple"):
        grow_layers(params, model.num_layers + 1)


def test_widened_heads_compute_what_the_trained_ones_did(rng):
    """widen_heads: SDAR's 32-wide heads (q/k RMSNorm, half-rotation RoPE) widened 2x and 4x give the same
    logits (float32, the norm's eps made negligible), the new dimensions start at zero; LLaDA (head_dim
    derived) and a width that is not a multiple are refused."""
    model = tiny_sdar_config(rms_norm_eps=1e-9)
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 2 else p, init_params(model, jax.random.PRNGKey(4)))
    ids = jnp.asarray(rng.integers(3, model.vocab_size, (2, 12)))
    def logits(params, config):
        return np.asarray(jax.jit(lambda p: sdar.forward(p, ids, config=config)[0])(params))

    want = logits(params, model)
    for width in (2 * model.head_dim, 4 * model.head_dim):
        wide = widen_heads(params, model, width)
        np.testing.assert_allclose(logits(wide, dataclasses.replace(model, head_dim=width)), want, rtol=1e-5, atol=1e-5)
        assert wide["layers"]["q_proj"].shape[-1] == width and not np.any(wide["layers"]["v_proj"][..., 1::width // 32])
    with pytest.raises(ValueError, match="not a multiple"):
        widen_heads(params, model, model.head_dim + 8)
    with pytest.raises(ValueError, match="LLaDA's is hidden_size / num_heads"):
        widen_heads(init_params(tiny_llada_config(), jax.random.PRNGKey(0)), tiny_llada_config(), 64)


def test_regrouped_heads_keep_each_groups_first_member_exactly(rng):
    """regroup_heads: LLaDA's 8 query / 4 KV heads merged into 4 / 2 twice as wide. A merged head's logits are
    the sum of its members', so with every second member silenced (zero query, key, value and output weights:
    the heads that use an odd KV head) the 4-head model computes exactly what the 8-head one did: the first
    members keep their RoPE frequencies, their logit scale and their own keys. A head count that does not
    divide both head counts, and a model with q/k norms, are refused."""
    model = tiny_llada_config(num_heads=8, num_kv_heads=4)
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 2 else p, init_params(model, jax.random.PRNGKey(5)))
    odd_kv = np.arange(model.num_kv_heads) % 2 == 1
    odd_q = np.repeat(odd_kv, model.num_heads // model.num_kv_heads)
    layers = dict(params["layers"])
    for name, silenced, axis in (("q_proj", odd_q, 2), ("o_proj", odd_q, 1), ("k_proj", odd_kv, 2),
                                 ("v_proj", odd_kv, 2)):
        keep = jnp.asarray(~silenced, jnp.float32).reshape((-1,) + (1,) * (layers[name].ndim - axis - 1))
        layers[name] = layers[name] * keep
    params = {**params, "layers": layers}
    ids = jnp.asarray(rng.integers(3, model.vocab_size, (2, 12)))

    def logits(params, config):
        return np.asarray(jax.jit(lambda p: llada.forward(p, ids, config=config)[0])(params))

    merged = dataclasses.replace(model, num_heads=4, num_kv_heads=2)
    regrouped = regroup_heads(params, model, 4)
    assert regrouped["layers"]["q_proj"].shape[-2:] == (4, 2 * model.head_dim)
    np.testing.assert_allclose(logits(regrouped, merged), logits(params, model), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not divide"):
        regroup_heads(params, model, 3)
    with pytest.raises(ValueError, match="without q/k norms"):
        regroup_heads(init_params(tiny_sdar_config(), jax.random.PRNGKey(0)), tiny_sdar_config(), 2)


def test_command_line_task_options_reach_the_batches(tmp_path, capsys):
    """--niah-needles / --vt-hops / --vt-ask-back: the training prompts hold that many needles / hops and ask
    that variable (a curriculum); several values mix; a combination the task refuses stops the run."""
    from dllm_jax.eval import build_tokenizer

    tokenizer = build_tokenizer()
    args = build_parser().parse_args(["--seed", "0", "--family", "llada", "--task", "niah_multikey", "--context", "128",
                                      "--batch", "3", "--steps", "5", "--niah-needles", "1", "--out", "unused"])
    for step in range(3):
        for row in batch_source(args, tokenizer)(step).tokens:
            assert tokenizer.decode(row.tolist()).count("magic number for") == 2  # the one needle and the question
    mixed = build_parser().parse_args(["--seed", "0", "--family", "sdar", "--task", "variable_tracking,passkey",
                                       "--context", "128", "--batch", "24", "--steps", "5", "--vt-hops", "0,1",
                                       "--out", "unused"])
    texts = [tokenizer.decode(row.tolist()) for row in batch_source(mixed, tokenizer)(0).tokens]
    hops = collections.Counter(text.count("= VAR") for text in texts if "VAR" in text)
    assert set(hops) == {0, 2} and min(hops.values()) >= 3  # two chains: no hop, or one hop each
    first = build_parser().parse_args(["--seed", "0", "--family", "sdar", "--task", "variable_tracking",
                                       "--context", "64", "--batch", "4", "--steps", "5", "--vt-ask-back", "1",
                                       "--out", "unused"])
    for row in batch_source(first, tokenizer)(0).tokens:  # one hop: the question names the variable holding the value
        text = tokenizer.decode(row.tolist())
        assert f"VAR {text.split('value of VAR ')[1].split()[0]} = VAR" not in text
    assert train_main(["--family", "llada", "--task", "passkey", "--context", "64", "--steps", "3", "--warmup", "1",
                       "--vt-hops", "0", "--out", str(tmp_path)]) == 2
    assert "which --task does not train" in capsys.readouterr().err
    assert train_main(["--family", "sdar", "--task", "variable_tracking", "--context", "64", "--steps", "3",
                       "--vt-hops", "0,1", "--vt-ask-back", "1", "--out", str(tmp_path)]) == 2
    assert "ask_back=1 goes past the chain's first variable: at most hops=0" in capsys.readouterr().err
