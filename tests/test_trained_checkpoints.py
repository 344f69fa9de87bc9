"""The trained checkpoints shipped in checkpoints/ (see checkpoints/README.md): they load through the HF
path and through conversion to Orbax, and answer fresh samples (evaluation seeds lie below the
training seeds, which start at 2**31)."""

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import dllm_jax
from dllm_jax import eval as dev
from dllm_jax.checkpoint.api import convert_hf_checkpoint
from dllm_jax.testing import user_environment
from dllm_jax.train.data import TRAIN_SEED_FLOOR

HERE = Path(__file__).parent
CHECKPOINTS = HERE.parent / "checkpoints"
TRAINED = {"tiny-sdar-tasks": "SDAR", "tiny-llada-tasks": "LLaDA"}
LONG = {"tiny-sdar-long": "SDAR", "tiny-llada-long": "LLaDA"}  # trained to 16k (issue 39's bar: >= 95% at 1k-16k)
# how the 4k test decodes each: LLaDA through Fast-dLLM's dual cache (threshold 0.9), where one token per step would
# run a full 4k forward per answer token (109 s on 2 cores against ~27 s); the SDAR as evaluate does
LONG_OPTIONS = {"tiny-sdar-long": {}, "tiny-llada-long": {"cache": "dual", "threshold": 0.9}}
SHIPPED = TRAINED | LONG
# what both models reach >= 95% on with fresh seeds (checkpoints/README.md), checked here on small samples
LEARNED = [("passkey", 1024), ("niah_multikey", 1024), ("variable_tracking", 1024), ("sanity", 64)]


@pytest.fixture(scope="module")
def models():
    """{name: model in float32} of every shipped checkpoint, loaded once for the module."""
    return {name: dllm_jax.load_model(CHECKPOINTS / name, dtype="float32", progress=False) for name in SHIPPED}


@pytest.fixture(params=sorted(SHIPPED))
def trained(request, models):
    """(directory, model in float32) of one shipped checkpoint."""
    return CHECKPOINTS / request.param, models[request.param]


@pytest.fixture(scope="module")
def tokenizer():
    return dev.load_tokenizer(CHECKPOINTS / "tiny-sdar-tasks")


def test_shipped_checkpoint_is_small_and_uses_the_task_tokenizer(trained):
    directory, model = trained
    assert type(model).__name__ == SHIPPED[directory.name]
    assert (directory / "model.safetensors").stat().st_size <= 25 * 2**20
    assert dev.load_tokenizer(directory).get_vocab() == dev.build_tokenizer().get_vocab()
    config, ids = model.config, dev.SPECIAL_IDS
    eos = config.eos_token_ids if SHIPPED[directory.name] == "SDAR" else (config.eos_token_id,)
    assert (config.mask_token_id, config.pad_token_id, eos) == (ids.mask, ids.pad, (ids.eos,))
    assert config.vocab_size >= dev.VOCAB_SIZE


def test_shipped_checkpoint_converts_to_the_same_model(trained, tmp_path, rng):
    directory, model = trained
    out = tmp_path / "orbax"
    convert_hf_checkpoint(directory, out, progress=False)
    converted = dllm_jax.load_model(out, dtype="float32", progress=False)
    ids = rng.integers(3, dev.VOCAB_SIZE, (1, 48))
    np.testing.assert_allclose(np.asarray(converted(ids)), np.asarray(model(ids)), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    """answered(name, cells, dtype, options) -> {(task, context): record} of 10 samples per cell (generate options
    `options`, e.g. Fast-dLLM's dual cache), each cell on a fresh
    evaluation seed (never a training one), from one process per checkpoint (tests/evaluate_cells.py) that
    compiles as a user's does: the 1k-token LLaDA passes are execution-bound, ~2.4x slower under `make
    test`'s LLVM -O0 (TEST_XLA_FLAGS). One process for a model's cells, not one per cell: each start
    (import, load, compile) costs ~9 s on 2 cores. Computed once per (name, cells, dtype) for the module."""
    done = {}

    def run(name: str, cells: list[tuple[str, int]], dtype: str, options: dict | None = None) -> dict:
        options = options or {}
        key = (name, tuple(cells), dtype, json.dumps(options, sort_keys=True))
        if key not in done:
            rng = np.random.default_rng(zlib.crc32(f"{name} {dtype}".encode()))
            seeds = rng.integers(0, TRAIN_SEED_FLOOR, len(cells))
            out = tmp_path_factory.mktemp("cells") / "cells.json"
            args = [f"{task}:{context}:{seed}" for (task, context), seed in zip(cells, seeds)]
            run = subprocess.run([sys.executable, str(HERE / "evaluate_cells.py"), str(CHECKPOINTS / name), dtype,
                                  str(out), json.dumps(options), *args], env=user_environment(os.environ),
                                 capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stderr[-3000:]
            done[key] = {(r["task"], r["context"]): r for r in json.loads(out.read_text())}
        return done[key]

    return run


def assert_answers(record: dict, task: str, context: int) -> None:
    """>= 9 of the cell's 10 samples right."""
    assert record["num_samples"] == 10 and record["tasks"] == [task] and record["context_lengths"] == [context]
    assert record["accuracy"] >= 0.9, (record["seed"], record["answers"])


@pytest.mark.parametrize("name, task, context", [(n, t, c) for n in TRAINED for t, c in LEARNED])
def test_shipped_checkpoint_answers_fresh_samples(answered, name, task, context):
    """In bfloat16, the dtype the weights are stored in (10 LLaDA passkey samples at 1k on 2 cores: 12.7 s
    of generation, 27.5 s before the CPU attention ran head-major)."""
    assert_answers(answered(name, LEARNED, "bfloat16")[(task, context)], task, context)


def test_int8_quantized_checkpoint_answers_fresh_passkey_samples(answered):
    """Issue 42's bar on CPU: the SDAR checkpoint with its linear weights quantized to int8 at load
    (`load_model(quantize="int8")`) answers >= 9 of 10 fresh passkey samples at 1k."""
    cell = ("passkey", 1024)
    assert_answers(answered("tiny-sdar-tasks", [cell], "bfloat16:int8")[cell], *cell)


@pytest.mark.parametrize("name", sorted(LONG))
def test_long_context_checkpoint_answers_fresh_samples_at_4k(answered, name):
    """Variable tracking (the task the long runs found hardest) at 4k tokens, in bfloat16 (~30 s for the
    10 samples on 2 cores, most of it the 4k prefill; float32 is slower there)."""
    cell = ("variable_tracking", 4096)
    assert_answers(answered(name, [cell], "bfloat16", LONG_OPTIONS[name])[cell], *cell)


def test_evaluation_is_deterministic_for_a_seed(trained, tokenizer):
    _, model = trained

    def predictions():
        samples = dev.make_samples("passkey", context_length=256, num_samples=3, seed=7, tokenizer=tokenizer)
        return [r.predicted_ids for r in dev.evaluate(model, samples, tokenizer=tokenizer, progress=False).records]

    assert predictions() == predictions()
