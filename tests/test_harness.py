"""The lm-evaluation-harness model (dllm_jax.eval.harness) and the likelihood it reports
(dllm_jax.eval.likelihood): the estimate against the official LLaDA evaluation's formula in PyTorch on the same
weights and masks, and both request types through the harness's own command line on a local task."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dllm_jax import load_model
from dllm_jax.eval import load_tokenizer, make_samples
from dllm_jax.eval.harness_tasks import write_task
from dllm_jax.eval.likelihood import answer_blocks, log_likelihood, mask_draw, masked_log_likelihood
from dllm_jax.testing import tiny_dream_config, tiny_llada_config, tiny_sdar_config, user_environment
from torch_reference import block_causal_logits, llama_reference, qwen3_reference, reference_logits

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "tiny-llada-tasks"


def official_estimate_term(reference, prompt, answer, masks, mask_id) -> float:
    """The official evaluation's term for one batch (its get_log_likelihood loop body), with the masks given."""
    rows, p = masks.shape[0], len(prompt)
    seq = torch.as_tensor(np.tile(np.concatenate([prompt, answer]), (rows, 1)), dtype=torch.long)
    is_mask = torch.cat([torch.zeros(rows, p, dtype=torch.bool), torch.as_tensor(masks)], dim=1)
    p_mask = torch.as_tensor(masks.sum(axis=1) / len(answer))[:, None].repeat(1, seq.shape[1])
    perturbed = torch.where(is_mask, mask_id, seq)
    logits = torch.as_tensor(reference_logits(reference, perturbed.numpy()))
    loss = F.cross_entropy(logits[is_mask], seq[is_mask], reduction="none") / p_mask[is_mask]
    return -(loss.sum() / rows).item()


def test_the_estimate_is_the_official_formula_on_the_same_weights_and_masks(tiny_checkpoint, rng):
    config = tiny_llada_config()
    directory = tiny_checkpoint(config, seed=5)
    model, reference = load_model(directory, dtype="float32", progress=False), llama_reference(directory)
    prompt = rng.integers(0, config.mask_token_id, 11)
    for length, rows in ((7, 4), (1, 3), (16, 5)):
        answer = rng.integers(0, config.mask_token_id, length)
        masks = mask_draw(rng, rows, length)
        counts = masks.sum(axis=1)
        assert counts.min() >= 1 and counts.max() <= length  # every row masks at least one answer token
        ours = masked_log_likelihood(model, prompt, answer, masks)
        official = official_estimate_term(reference, prompt, answer, masks, config.mask_token_id)
        assert abs(ours - official) <= 1e-4 * abs(official), (length, ours, official)
    answer = rng.integers(0, config.mask_token_id, 7)
    estimate = log_likelihood(model, prompt, answer, mc_num=8, batch_size=4, seed=3)
    assert estimate == log_likelihood(model, prompt, answer, mc_num=8, batch_size=4, seed=3) < 0  # reproducible
    with pytest.raises(ValueError, match="mc_num=6 must be a multiple of batch_size=4"):
        log_likelihood(model, prompt, answer, mc_num=6, batch_size=4)


def test_a_block_diffusion_estimate_is_the_formula_per_block_given_the_clean_blocks_before(tiny_checkpoint, tiny_model,
                                                                                         rng):
    """SDAR: each term masks the answer tokens of one block (the prompt's last block holds the answer's first
    ones), and equals the formula computed in PyTorch on the sequence cut after that block, every earlier position
    clean: what comes after a block does not reach it."""
    config = tiny_sdar_config()
    directory = tiny_checkpoint(config, seed=6)
    model, reference = tiny_model(config, seed=6), qwen3_reference(directory)
    bs = config.block_size
    prompt, answer = rng.integers(0, config.mask_token_id, 11), rng.integers(0, config.mask_token_id, 10)
    blocks = answer_blocks(model, len(prompt), len(answer))
    assert [list(b) for b in blocks] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]  # positions 11 | 12-15 | 16-19 | 20
    whole = np.concatenate([prompt, answer])
    for positions in blocks:
        masks = mask_draw(rng, 3, len(positions))
        ours = masked_log_likelihood(model, prompt, answer, masks, positions)
        end = len(prompt) + positions[-1] + 1
        ids = np.tile(whole[:end], (3, 1))
        scored = len(prompt) + positions
        ids[:, scored] = np.where(masks, config.mask_token_id, ids[:, scored])
        log_probs = torch.log_softmax(torch.as_tensor(block_causal_logits(reference, ids, bs)[:, scored]), -1)
        picked = log_probs.gather(-1, torch.as_tensor(whole[scored]).long()[None, :, None].expand(3, -1, 1))[..., 0]
        p_mask = torch.as_tensor(masks.sum(axis=1) / len(positions))[:, None]
        expected = ((picked * torch.as_tensor(masks)) / p_mask).sum().item() / 3
        assert abs(ours - expected) <= 1e-4 * abs(expected), (list(positions), ours, expected)
    estimate = log_likelihood(model, prompt, answer, mc_num=4, batch_size=2, seed=1)
    assert estimate == log_likelihood(model, prompt, answer, mc_num=4, batch_size=2, seed=1) < 0
    with pytest.raises(ValueError, match="not Dream"):
        log_likelihood(tiny_model(tiny_dream_config()), prompt, answer, mc_num=2, batch_size=2)


def test_the_harness_model_scores_a_block_diffusion_checkpoint_and_rolling_text(checkpoints, rng):
    """The lm-eval model on a tiny SDAR checkpoint in this process: loglikelihood is the block estimate of the
    continuation, loglikelihood_rolling of a text shorter than the model's positions is one window's estimate
    (the context: the model's last stop id), and the greedy check decodes with the family's evaluation options."""
    from lm_eval.api.instance import Instance

    from dllm_jax.eval.harness import DllmJaxLM

    lm = DllmJaxLM(checkpoint=str(checkpoints[1]), dtype="float32", mc_num=4, batch_size=2, is_check_greedy=True)
    ids = [int(i) for i in rng.integers(3, 140, 9)]
    text = lm.tokenizer.decode(ids)
    assert lm.encode(text) == ids
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    stop = lm.model.config.stop_ids[-1]
    assert rolling == log_likelihood(lm.model, [stop], ids, mc_num=4, batch_size=2, seed=0) < 0
    context, continuation = lm.tokenizer.decode(ids[:5]), " " + lm.tokenizer.decode(ids[5:])
    ((ll, greedy),) = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    assert ll == log_likelihood(lm.model, ids[:5], ids[5:], mc_num=4, batch_size=2, seed=0)
    assert isinstance(greedy, bool)


def test_mask_counts_are_stratified_over_the_answer_length():
    rng = np.random.default_rng(0)
    for _ in range(20):
        counts = np.sort(mask_draw(rng, 8, 16).sum(axis=1))
        assert counts.min() >= 1 and counts.max() <= 16
        assert len(np.unique(counts)) == 8  # 8 rows over 16 counts: evenly spaced, all different


def test_lm_eval_scores_both_request_types_through_its_own_command_line(tmp_path):
    """The shipped tiny LLaDA on a local passkey task (no download): multiple choice among the key and two
    distractors by log-likelihood, and the key generated; the harness writes its results."""
    tokenizer = load_tokenizer(CHECKPOINT)
    samples = make_samples("passkey", 64, 3, 11, tokenizer)
    tasks = {"dllm_passkey_choice": "choice", "dllm_passkey_answer": "generate"}
    for name, kind in tasks.items():
        write_task(tmp_path, name, samples, tokenizer, kind=kind, answer_tokens=8, distractors=2)
    docs = [json.loads(line) for line in (tmp_path / "dllm_passkey_choice.jsonl").read_text().splitlines()]
    assert all(len(d["choices"]) == 3 and d["choices"][d["label"]] == d["answer"] for d in docs)
    env = user_environment(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "dllm_jax.eval.harness", "--model", "dllm_jax", "--model_args",
         f"checkpoint={CHECKPOINT},dtype=float32,mc_num=4,is_check_greedy=true", "--batch_size", "2",
         "--include_path", str(tmp_path), "--tasks", ",".join(tasks), "--output_path",
         str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    choice, answer = results["dllm_passkey_choice"], results["dllm_passkey_answer"]
    assert 0 <= choice["acc,none"] <= 1 and 0 <= answer["exact_match,strip"] <= 1


def test_a_local_task_refuses_an_unknown_kind_and_answers_without_digits_for_choices(tmp_path):
    tokenizer = load_tokenizer(CHECKPOINT)
    samples = make_samples("passkey", 64, 1, 11, tokenizer)
    with pytest.raises(ValueError, match="kind='ranking' is not one of"):
        write_task(tmp_path, "t", samples, tokenizer, kind="ranking")
    worded = [dataclasses.replace(samples[0], answer="blue")]
    with pytest.raises(ValueError, match="a choice task needs answers holding digits"):
        write_task(tmp_path, "t", worded, tokenizer, kind="choice")
