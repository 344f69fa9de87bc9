"""DiffusionGemma's text model against transformers' own: a tiny random `DiffusionGemmaForBlockDiffusion`
(sliding and global layers, MoE beside the dense MLP, every norm, scale and layer_scalar randomized) written
by `save_pretrained`, loaded by `dllm_jax.load_model`, and its fp32 canvas logits compared; plus the config and
tensor checks, and the family's way through the registry (convert, load, generate, the command line, the
server). Expected values come from transformers."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import DiffusionGemmaConfig as HFConfig
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler, EntropyBoundSamplerConfig

import dllm_jax
from dllm_jax.checkpoint.hf import plan_conversion
from dllm_jax.cli import main
from dllm_jax.cli.serve import FLAGS, family_options
from dllm_jax.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.eval.evaluate import check_samples
from dllm_jax.families import family_of
from dllm_jax.generate import diffusion_gemma as gen
from dllm_jax.generate.requests import until_stop
from dllm_jax.attention import mage
from dllm_jax.attention.mage import MAGE
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.serve.app import build_app, running
from dllm_jax.serve.lockstep import LockstepEngine
from dllm_jax.testing import write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOLERANCE = 1e-4  # max |diff| / max |reference|, fp32
WINDOW = 4
# sliding and global layers in Gemma-4's pattern (global last); global layers with a wider head, one KV head
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"],
            num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# the smallest vision tower transformers builds (the port skips it)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, position_embedding_size=16, patch_size=2)


def load(path):
    """(config, fp32 inference params) of a checkpoint folder, through the registry's loader."""
    model = dllm_jax.load_model(path, dtype="float32", progress=False)
    return model.config, model.params()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, folder it was saved to, the port's config, the port's params)."""
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(HFConfig(text_config=TEXT, vision_config=VISION)).eval()
    with torch.no_grad():  # away from the initial ones and zeros, so that every tensor's role is exercised
        for name, param in model.named_parameters():
            if "vision" not in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
    path = tmp_path_factory.mktemp("diffusion_gemma")
    model.save_pretrained(path)
    config, params = load(path)
    return model, path, config, params


def reference(model, ids, canvas, logits=None) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(canvas),
                    self_conditioning_logits=None if logits is None else torch.as_tensor(logits))
    return out.logits.numpy()


def relative(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out) - ref)) / np.max(np.abs(ref)))


def inputs(rng, batch: int, prompt: int, canvas: int = 6):
    return (rng.integers(0, 128, (batch, prompt)).astype(np.int64), rng.integers(0, 128, (batch, canvas)).astype(
        np.int64), (rng.standard_normal((batch, canvas, 128)) * 3).astype(np.float32))


def test_config_reads_per_layer_shapes(checkpoint):
    _, _, config, _ = checkpoint
    assert config.head_dims == (16, 32, 16, 32) and config.kv_heads == (2, 1, 2, 1)
    assert config.rope_of("full_attention").rotated == 4  # partial_rotary_factor 0.25 of 32 / 2 frequencies


@pytest.mark.parametrize("prompt", [11, 2], ids=["prompt past the window", "prompt inside the window"])
@pytest.mark.parametrize("self_conditioning", [False, True], ids=["first step", "self-conditioned"])
def test_canvas_logits_match_transformers(checkpoint, rng, prompt, self_conditioning):
    model, _, config, params = checkpoint
    ids, canvas, logits = inputs(rng, 2, prompt)
    logits = logits if self_conditioning else None
    out = dg.forward(params, ids, canvas, logits, config=config)
    assert out.dtype == np.float32 and out.shape == (2, 6, 128)
    assert relative(out, reference(model, ids, canvas, logits)) <= TOLERANCE


def test_rows_of_different_prompt_lengths_match_each_alone(checkpoint, rng):
    """Right-padded prompts with per-row fill lengths: each row's canvas sits after its own prompt."""
    model, _, config, params = checkpoint
    ids, canvas, logits = inputs(rng, 2, 9)
    lengths = np.array([9, 5], np.int32)
    cache = dg.init_cache(config, 2, 9 + 6)
    cache = dg.encode(params, ids, cache, lengths, config=config)
    out, after = dg.decode(params, canvas, cache, logits, config=config)
    assert np.array_equal(after.length, lengths)
    for row, n in enumerate(lengths):
        ref = reference(model, ids[row:row + 1, :n], canvas[row:row + 1], logits[row:row + 1])
        assert relative(out[row:row + 1], ref) <= TOLERANCE


def test_a_sliding_layer_reads_only_its_window_of_the_cache(checkpoint):
    """`sliding_view`: window - 1 positions before the new tokens and theirs, per row, whatever the buffer's length;
    the whole buffer where that is not shorter."""
    _, _, config, _ = checkpoint
    cache = dg.init_cache(config, 2, 40)
    cache = cache.replace(k=tuple(k + jnp.arange(40)[None, :, None, None] for k in cache.k))  # key j holds j
    keys, _, seen = dg.sliding_view(cache, 0, jnp.asarray([20, 2]), 6, WINDOW)
    assert keys.shape[1] == seen.shape[1] == WINDOW - 1 + 6
    assert seen[0].tolist() == list(range(20 - (WINDOW - 1), 26)) and seen[1].tolist() == list(range(0, 9))
    assert np.array_equal(keys[:, :, 0, 0], seen)
    assert dg.sliding_view(dg.init_cache(config, 1, 8), 0, jnp.asarray([2]), 6, WINDOW)[2].shape == (1, 8)


def test_prompt_encoded_in_two_calls_matches_one(checkpoint, rng):
    """Appending to the cache (a prompt in two pieces, the second attending to the first through the cache)
    gives transformers' logits of the whole prompt."""
    model, _, config, params = checkpoint
    ids, canvas, _ = inputs(rng, 2, 11)
    cache = dg.init_cache(config, 2, 11 + 6)
    cache = dg.encode(params, ids[:, :7], cache, config=config)
    cache = dg.encode(params, ids[:, 7:], cache, config=config)
    out, _ = dg.decode(params, canvas, cache, config=config)
    assert relative(out, reference(model, ids, canvas)) <= TOLERANCE


# --- config checks ---------------------------------------------------------------------------------------

def text_edit(key, value):
    def edit(hf):
        if value is DELETE:
            del hf["text_config"][key]
        else:
            hf["text_config"][key] = value
    return edit


DELETE = object()
BAD_CONFIGS = {
    "use_bidirectional_attention": text_edit("use_bidirectional_attention", "all"),
    "attention_bias": text_edit("attention_bias", True),
    "num_experts": text_edit("num_experts", DELETE),
    "hidden_size": text_edit("hidden_size", DELETE),
    "rope_type": lambda hf: hf["text_config"]["rope_parameters"]["full_attention"].update(rope_type="yarn"),
    "layer_types": text_edit("layer_types", ["chunked_attention"] * 3 + ["full_attention"]),
    "per_layer_config": lambda hf: hf["text_config"]["per_layer_config"]["1"].update(intermediate_size=8),
    "tie_word_embeddings": lambda hf: hf.update(tie_word_embeddings=False),
    "hidden_activation": text_edit("hidden_activation", "silu"),
    "num_attention_heads": text_edit("num_attention_heads", 3),
}


@pytest.mark.parametrize("key", list(BAD_CONFIGS))
def test_unsupported_or_missing_config_key_is_named(checkpoint, key):
    _, path, _, _ = checkpoint
    hf = json.loads((path / "config.json").read_text())
    DiffusionGemmaConfig.from_hf_config(hf)  # the file as written is accepted
    BAD_CONFIGS[key](hf)
    with pytest.raises(ValueError, match=key):
        DiffusionGemmaConfig.from_hf_config(hf)


# --- tensor checks ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tensors(checkpoint):
    _, path, _, _ = checkpoint
    return load_file(str(path / "model.safetensors"))


def folder(tmp_path, checkpoint, tensors: dict):
    """A checkpoint folder of `tensors` and the checkpoint's config.json."""
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint[1] / "config.json").read_text())
    return tmp_path


def test_vision_and_tied_tensors_are_skipped(checkpoint, tensors, tmp_path):
    """The vision tower, the encoder's copies of the decoder's text weights and a tied LM head are held by a file
    but not read; the decoder's copy is."""
    _, _, config, params = checkpoint
    assert any(name.startswith("model.encoder.vision_tower.") for name in tensors)
    name = "model.decoder.layers.1.mlp.gate_proj.weight"
    extra = {"model.encoder.vision_tower.extra": np.zeros(3, np.float32), "lm_head.weight": tensors[
        "model.decoder.embed_tokens.weight"], name.replace("model.decoder.", "model.encoder.language_model."): 0 *
        tensors[name]}
    _, loaded = load(folder(tmp_path, checkpoint, dict(tensors, **extra)))
    assert np.array_equal(loaded["layers"][1]["gate_up_proj"], params["layers"][1]["gate_up_proj"])


def bad_tensors(tensors):
    name = "model.decoder.layers.2.self_attn.v_proj.weight"
    return {
        "missing": (lambda t: t.pop(name), rf"{name}: missing"),
        "misshaped": (lambda t: t.update({name: t[name][:-1]}),
                      rf"{name}: shape \[31, 64\], config expects \[32, 64\]"),
        "unexpected": (lambda t: t.update({"model.decoder.layers.0.extra.weight": t[name]}),
                       "model.decoder.layers.0.extra.weight: unexpected tensor"),
        "global layer with a value projection": (
            lambda t: t.update({"model.decoder.layers.1.self_attn.v_proj.weight": t[name]}),
            "model.decoder.layers.1.self_attn.v_proj.weight: unexpected tensor"),
        "encoder layer_scalar missing": (lambda t: t.pop("model.encoder.language_model.layers.0.layer_scalar"),
                                         "model.encoder.language_model.layers.0.layer_scalar: missing"),
        "only the encoder's copy": (
            lambda t: t.update({name.replace("model.decoder.", "model.encoder.language_model."): t.pop(name)}),
            rf"{name}: missing"),
    }


@pytest.mark.parametrize("case", ["missing", "misshaped", "unexpected", "global layer with a value projection",
                                  "encoder layer_scalar missing", "only the encoder's copy"])
def test_bad_tensor_is_named(checkpoint, tensors, case, tmp_path):
    """The converter's validation (from the file headers, before any data is read) names each bad tensor."""
    _, _, config, _ = checkpoint
    edit, pattern = bad_tensors(tensors)[case]
    broken = dict(tensors)
    edit(broken)
    with pytest.raises(ValueError, match=pattern):
        plan_conversion(folder(tmp_path, checkpoint, broken), config)


def test_checkpoint_folder_in_shards_loads(checkpoint, tensors, tmp_path):
    _, path, _, params = checkpoint
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({name: tensors[name] for name in part}, str(tmp_path / f"model-{i}.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _, loaded = load(tmp_path)
    assert np.array_equal(loaded["layers"][3]["experts_down"], params["layers"][3]["experts_down"])


def test_forward_refuses_misshaped_self_conditioning_logits(checkpoint, rng):
    _, _, config, params = checkpoint
    ids, canvas, logits = inputs(rng, 2, 5)
    with pytest.raises(ValueError, match="self_conditioning_logits"):
        dg.forward(params, ids, canvas, logits[:, :, :64], config=config)


def test_unconditioned_rows_match_transformers_self_conditioning_mask(checkpoint, rng):
    """`conditioned` False on a row zeroes its signal, as transformers' self_conditioning_mask does."""
    model, _, config, params = checkpoint
    ids, canvas, logits = inputs(rng, 2, 11)
    cache = dg.encode(params, ids, dg.init_cache(config, 2, 11 + 6), config=config)
    out, _ = dg.decode(params, canvas, cache, logits, config=config, conditioned=np.array([True, False]))
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(canvas),
                    self_conditioning_logits=torch.as_tensor(logits),
                    self_conditioning_mask=torch.tensor([True, False])).logits.numpy()
    assert relative(out, ref) <= TOLERANCE
    assert relative(out[1], reference(model, ids, canvas)[1]) <= TOLERANCE  # row 1 as on a first step


# --- generation ------------------------------------------------------------------------------------------

CANVAS = 8


class InjectedDraws:
    """transformers' sampler fed this port's draws (`initial_canvas`, `step_draws`): its canvas initialisation and
    re-noising take the port's tokens, its multinomial samples by the inverse CDF at the port's uniforms."""

    def __init__(self, seed: int, config):
        self.key, self.config = jax.random.key(seed), config
        self.canvas, self.step = -1, 0
        self.sampled = False  # a multinomial call of this step has run: the next canvas draw is its re-noising

    def initialize_canvas(self, sampler, batch_size: int, device):
        if self.sampled:
            tokens = gen.step_draws(self.key, self.canvas, self.step, self.config)[1]
            self.sampled, self.step = False, self.step + 1
        else:
            self.canvas, self.step = self.canvas + 1, 0
            tokens = gen.initial_canvas(self.key, self.canvas, self.config)
        return torch.as_tensor(np.asarray(tokens), dtype=torch.long).expand(batch_size, -1).clone()

    def multinomial(self, probs, num_samples):
        uniforms = torch.as_tensor(np.asarray(gen.step_draws(self.key, self.canvas, self.step, self.config)[0]))
        rows = probs.shape[0] // self.config.canvas_length
        below = torch.cumsum(probs, dim=-1) < uniforms.repeat(rows)[:, None]
        self.sampled = True
        return below.sum(dim=-1).clamp(max=probs.shape[-1] - 1)[:, None]


def transformers_generate(model, prompt, options, seed, config, eos, monkeypatch):
    """(tokens [B, N], tokens per forward [B]) of transformers' generate with the port's draws."""
    draws = InjectedDraws(seed, config)
    monkeypatch.setattr(EntropyBoundSampler, "initialize_canvas",
                        lambda sampler, batch_size, device: draws.initialize_canvas(sampler, batch_size, device))
    monkeypatch.setattr(torch, "multinomial", draws.multinomial)
    model.config.canvas_length = CANVAS
    with torch.no_grad():
        out = model.generate(input_ids=torch.as_tensor(prompt), max_new_tokens=options.max_new_tokens,
                             max_denoising_steps=options.max_denoising_steps,
                             sampler_config=EntropyBoundSamplerConfig(entropy_bound=options.entropy_bound),
                             t_min=options.t_min, t_max=options.t_max, stability_threshold=options.stability_threshold,
                             confidence_threshold=options.confidence_threshold, eos_token_id=eos, pad_token_id=0)
    monkeypatch.undo()
    return out.sequences.numpy(), out.tokens_per_forward.numpy()


def port_generate(params, prompt, options, seed, config, eos):
    """(tokens [N], tokens per forward) of the port's loop on one prompt (counted as transformers counts: generated
    tokens that are not the pad id, over the forwards the row needed)."""
    out, ran, forwards = gen.generate_canvases_jit(params, prompt.astype(np.int32), np.asarray([prompt.shape[1]]),
                                                   jax.random.key(seed), config=config, options=options,
                                                   stop_ids=(eos,), pad_id=0)
    new = np.asarray(out)[0, :int(ran) * CANVAS]
    return np.concatenate([prompt[0], new]), np.count_nonzero(new) / int(forwards[0])


@pytest.fixture(scope="module")
def calm(checkpoint, tmp_path_factory):
    """The random model with its self-conditioning output scaled to a tenth: (transformers model, the port's config
    with canvases of CANVAS tokens, params). At full scale the random model's self-conditioning loop amplifies
    fp32 rounding (the two implementations' canvas logits, 3e-6 apart given the same inputs, drift apart 4-10x per
    step), so after tens of steps the same draws sample different tokens; at a tenth it does not."""
    model = copy.deepcopy(checkpoint[0])
    with torch.no_grad():
        model.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
    path = tmp_path_factory.mktemp("diffusion_gemma_calm")
    model.save_pretrained(path)
    config, params = load(path)
    return model, dataclasses.replace(config, canvas_length=CANVAS), params


# near greedy, rows stop once their argmax canvas is stable (the entropy is about 0); at the defaults' temperatures
# the random model's entropies stay above 3, so stopping there needs a confidence threshold above them
GENERATION = {"near greedy": dict(t_min=0.001, t_max=0.002, max_denoising_steps=12, max_new_tokens=24),
              "the defaults": dict(max_new_tokens=16),
              "confident": dict(max_new_tokens=16, max_denoising_steps=12, stability_threshold=0,
                                confidence_threshold=3.5),
              "hot, no stopping": dict(max_new_tokens=16, max_denoising_steps=12, t_min=0.9, t_max=1.5,
                                       confidence_threshold=None)}


@pytest.mark.parametrize("case", list(GENERATION))
def test_generation_equals_transformers_with_the_same_draws(calm, rng, case, monkeypatch):
    """Token for token, transformers' generate with this port's draws injected: canvases, entropy-bound acceptance,
    re-noising, the temperature schedule, self-conditioning, adaptive stopping, a stop id mid-canvas (its pad after,
    the generation ending there) and without one."""
    model, config, params = calm
    options = gen.DiffusionGemmaOptions(**GENERATION[case])
    prompt = rng.integers(2, 128, (1, 7))
    free, free_rate = port_generate(params, prompt, options, 3, config, 1)
    theirs, their_rate = transformers_generate(model, prompt, options, 3, config, 1, monkeypatch)
    assert np.array_equal(free, theirs[0]) and abs(free_rate - their_rate[0]) < 1e-6
    steps = options.max_denoising_steps * len(free[7:]) // CANVAS
    assert (free_rate > len(free[7:]) / steps) == (case in ("near greedy", "confident"))  # rows stopped early
    stop = int(free[7 + CANVAS // 2])  # a token of the first canvas: the generation stops there
    ours, _ = port_generate(params, prompt, options, 3, config, stop)
    theirs, _ = transformers_generate(model, prompt, options, 3, config, stop, monkeypatch)
    assert np.array_equal(ours, theirs[0])
    first = 7 + int(np.flatnonzero(ours[7:] == stop)[0])
    assert len(ours) == 7 + CANVAS and (ours[first + 1:] == 0).all()  # one canvas, padded after its stop
    assert np.array_equal(ours, gen.generate(params, [prompt[0]], config=config, options=options, seed=3,
                                             stop_ids=(stop,))[0])


def test_rows_of_a_batch_generate_what_each_generates_alone(calm, rng):
    """Prompts of different lengths in one batch: each row's canvases are those of its prompt alone."""
    _, config, params = calm
    options = gen.DiffusionGemmaOptions(max_new_tokens=16, max_denoising_steps=8)
    prompts = [rng.integers(2, 128, n) for n in (9, 4, 6)]
    together = gen.generate(params, prompts, config=config, options=options, seed=5)
    for prompt, row in zip(prompts, together):
        ids = np.zeros((1, 9), np.int32)  # alone, in one program for every prompt: a row of width 9, its length
        ids[0, :len(prompt)] = prompt
        alone, ran, _ = gen.generate_canvases_jit(params, ids, np.asarray([len(prompt)], np.int32), jax.random.key(5),
                                                  config=config, options=options, stop_ids=(), pad_id=0)
        assert np.array_equal(row[len(prompt):], np.asarray(alone)[0, :int(ran) * CANVAS])


def test_a_prompt_encoded_in_chunks_generates_what_it_does_in_one_pass(calm, rng):
    """The prefill in chunks of 4 positions (rows of 9, 4 and 6 tokens: three chunks, rows ending inside the first
    and the second) fills the cache as one pass does: the same canvases."""
    _, config, params = calm
    options = gen.DiffusionGemmaOptions(max_new_tokens=16, max_denoising_steps=8)
    ids = np.zeros((3, 9), np.int32)
    lengths = np.asarray([9, 4, 6], np.int32)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(2, 128, n)
    run = functools.partial(gen.generate_canvases_jit, params, ids, lengths, jax.random.key(5), config=config,
                            options=options, stop_ids=(), pad_id=0)
    whole, chunked = run(), run(prefill_chunk=4)
    assert int(whole[1]) == int(chunked[1]) == 2
    np.testing.assert_array_equal(np.asarray(chunked[0]), np.asarray(whole[0]))


@pytest.mark.parametrize("options, message", [
    (dict(max_denoising_steps=0), "max_denoising_steps"), (dict(t_min=0.8, t_max=0.4), "t_max=0.4 must be above"),
    (dict(entropy_bound=0.0), "entropy_bound"), (dict(stability_threshold=-1), "stability_threshold"),
    (dict(confidence_threshold=0.0), "confidence_threshold"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        gen.DiffusionGemmaOptions(**options)


# --- the registry: convert, load, generate, the command line, the server ----------------------------------------

VOCAB, EOS = 160, 141  # the tiny tokenizer's vocabulary and its <|im_end|> (dllm_jax.testing.write_tiny_tokenizer)
SERVED = dict(max_new_tokens=8, max_denoising_steps=2)


# --- MAGE on the canvases' global layers --------------------------------------------------------------------------

def attention_over(q, keys, values):
    """numpy softmax attention without a scale (DiffusionGemma's) of q [n, G, D] over keys, values [m, D]."""
    logits = np.einsum("ngd,md->ngm", q, keys)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("ngm,md->ngd", p / p.sum(-1, keepdims=True), values)


def test_canvas_attention_attends_to_the_selected_rows_and_the_canvas(rng):
    """`mage.canvas_attention` against numpy over the listed prefix rows (each KV head its own; a row whose prefix is
    shorter than k lists it whole and repeats its last row, which must not count twice) and the new tokens."""
    b, s, n, hkv, g, d, k = 2, 12, 3, 2, 2, 8, 4
    q = rng.standard_normal((b, n, hkv * g, d)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((b, n, hkv, d)).astype(np.float32) for _ in range(2))
    cache_k, cache_v = (rng.standard_normal((b, s, hkv, d)).astype(np.float32) for _ in range(2))
    prefix = np.array([9, 2])
    distinct = np.stack([np.sort(rng.choice(9, k, replace=False)) for _ in range(hkv)])
    indices = np.stack([distinct, [[0, 1, 1, 1], [1, 0, 0, 0]]])  # row 1: its 2 prefix rows, then repeats
    got = np.asarray(mage.canvas_attention(q, new_k, new_v, cache_k, cache_v, jnp.asarray(indices, jnp.int32),
                                           jnp.asarray(prefix, jnp.int32), scale=1.0, backend="xla"))
    for row in range(b):
        for h in range(hkv):
            rows = indices[row, h, :min(k, prefix[row])]
            keys = np.concatenate([cache_k[row, rows, h], new_k[row, :, h]])
            values = np.concatenate([cache_v[row, rows, h], new_v[row, :, h]])
            want = attention_over(q[row, :, h * g:(h + 1) * g], keys, values)
            np.testing.assert_allclose(got[row, :, h * g:(h + 1) * g], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softmax_over", ["prefix", "prefix+block"])
def test_canvas_prefix_scores_are_those_of_the_block_methods(rng, softmax_over):
    """The plain-jnp Eq. 3 a canvas ranks by equals `prefix_scores` (SDAR's MAGE, its reference backend) where that
    takes the shapes: a block of 3 queries after per-row prefixes of 9 and 2 positions, 2 query heads per KV head."""
    b, s, n, hkv, g, d = 2, 16, 3, 2, 2, 16
    q = rng.standard_normal((b, n, hkv * g, d)).astype(np.float32)
    cache_k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    prefix = jnp.asarray([9, 2], jnp.int32)
    got = mage.canvas_prefix_scores(q, cache_k, prefix, scale=d ** -0.5, softmax_over=softmax_over)
    want = mage.prefix_scores(q, cache_k, prefix_len=prefix, backend="reference", softmax_over=softmax_over)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert np.isneginf(np.asarray(got)[1, :, 2:]).all()


def encoded(config, params, prompts):
    """The cache after right-padded prompts (lists of ids), with room for one canvas."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    cache = dg.init_cache(config, len(prompts), int(lengths.max()) + config.canvas_length, jnp.float32)
    return dg.encode(params, ids, cache, lengths, config=config)


def test_mage_selects_per_row_and_is_exact_where_k_holds_the_prefix(calm, rng):
    """decode_mage: the selecting step is the dense step; a row's selection (ascending distinct prefix positions, its
    prefix whole where it has at most k) is that of its prompt alone; the later step over a selection that holds the
    whole prefix gives the dense logits; over a smaller one, other logits."""
    _, config, params = calm
    prompts = [rng.integers(2, 128, 11), rng.integers(2, 128, 3)]
    cache = encoded(config, params, prompts)
    canvas = rng.integers(0, 128, (2, config.canvas_length)).astype(np.int32)
    previous = jnp.asarray(rng.standard_normal((2, config.canvas_length, 128)) * 3, jnp.float32)
    dense, _ = dg.decode(params, canvas, cache, previous, config=config)
    method = MAGE(k=5, exact_layers=0)
    assert dg.sparse_layers(config, method) == (1, 3) and dg.sparse_layers(config, MAGE(exact_layers=2)) == (3,)
    first, _, selection = dg.decode_mage(params, canvas, cache, previous, config=config, method=method)
    assert relative(first, np.asarray(dense)) < 1e-5  # two programs: the same math up to fp32 rounding
    for layer, chosen in selection.items():
        chosen = np.asarray(chosen)
        assert chosen.shape == (2, config.kv_heads[layer], 5)
        assert all(len(set(h)) == 5 and list(h) == sorted(h) and h.max() < 11 for h in chosen[0])
        assert (chosen[1, :, :3] == np.arange(3)).all()  # 3 positions: all of them (the rest repeat the last)
    alone = dg.decode_mage(params, canvas[:1], encoded(config, params, prompts[:1]), previous[:1], config=config,
                           method=method)[2]
    assert all(np.array_equal(alone[layer][0], selection[layer][0]) for layer in selection)
    later, _, _ = dg.decode_mage(params, canvas, cache, previous, selection, config=config, method=method)
    assert relative(later[1], np.asarray(dense[1])) < 1e-5  # its prefix held whole
    assert relative(later[0], np.asarray(dense[0])) > 1e-3  # 5 of 11 positions
    whole = dg.decode_mage(params, canvas, cache, previous, config=config, method=MAGE(k=16, exact_layers=0))[2]
    later, _, _ = dg.decode_mage(params, canvas, cache, previous, whole, config=config,
                                 method=MAGE(k=16, exact_layers=0))
    assert relative(later, np.asarray(dense)) < 1e-5


def test_mage_generation_is_dense_where_k_holds_the_context_and_runs_short(calm, rng):
    """The sampler with MAGE: token for token dense generation while k holds every cached position (two canvases:
    the second attends to the first, selected too); with a small k, a different generation of the same length."""
    _, config, params = calm
    options = gen.DiffusionGemmaOptions(max_new_tokens=16, max_denoising_steps=6)
    prompts = [rng.integers(2, 128, 9), rng.integers(2, 128, 4)]
    run = functools.partial(gen.generate, params, prompts, config=config, options=options, seed=2)
    dense, whole, short = run(), run(method=MAGE(k=64, exact_layers=0)), run(method=MAGE(k=2, exact_layers=0))
    assert all(np.array_equal(a, b) for a, b in zip(dense, whole))
    assert [len(r) for r in short] == [len(r) for r in dense] and any(
        not np.array_equal(a, b) for a, b in zip(dense, short))


def test_the_mage_loop_traces_the_decoder_once(calm):
    """The canvas loop with MAGE runs its selecting first step and its later steps at one call site (each sparse
    layer's attention under a `lax.cond`): its program holds a few more dot products per sparse layer than the dense
    loop's, not a second copy of the decoder's."""
    _, config, params = calm
    options = gen.DiffusionGemmaOptions(max_new_tokens=16, max_denoising_steps=4)
    method = MAGE(k=4, exact_layers=0)

    def dots(method):
        lowered = gen.generate_canvases_jit.lower(params, np.ones((1, 8), np.int32), np.array([8], np.int32),
                                                  jax.random.key(0), options.sampling(), config=config,
                                                  options=options.structure(), stop_ids=(), pad_id=0, method=method)
        return lowered.as_text().count("stablehlo.dot_general")

    dense, sparse = dots(None), dots(method)
    assert dense < sparse <= dense + 4 * len(dg.sparse_layers(config, method))  # a decoder copy: about `dense` more


def test_generate_and_the_command_line_take_mage(registry):
    """method="mage" through dllm_jax.generate and `dllm-jax generate --method mage --mage-k`."""
    _, out, model = registry
    ids = np.array([[5, 6, 7, 8, 9]], np.int32)
    options = dict(max_new_tokens=8, max_denoising_steps=3, seed=1)
    via_name = np.asarray(dllm_jax.generate(model, ids, method="mage", **options))
    np.testing.assert_array_equal(via_name, dllm_jax.generate(model, ids, method=MAGE(), **options))
    status, text, err = cli(["generate", "--model", str(out), "--prompt", "w5 w6 w7", "--raw", "--gen-length", "8",
                             "--steps", "2", "--seed", "3", "--dtype", "float32", "--method", "mage", "--mage-k", "2",
                             "--exact-layers", "0"])
    assert status == 0, err
    expected = answer_text(model, ChatTokenizer(out), [5, 6, 7], 3, max_new_tokens=8, max_denoising_steps=2,
                           method=MAGE(k=2, exact_layers=0))
    assert text.rstrip("\n") == expected


@pytest.mark.gpu
def test_mage_on_a_gpu_with_512_wide_global_heads_is_dense_where_k_holds_the_prefix():
    """bf16 on a GPU with the 26B-A4B's global heads (512 wide, 8 query heads per KV head) and 256-token canvases: the
    selecting step is the dense step, a later step over a selection of the whole prefix gives the dense logits, and
    one over 64 of 1,000 positions other, finite logits."""
    from benchmarks.diffusion_gemma import TEXT_SMALL, random_inference_params

    text = TEXT_SMALL | dict(num_hidden_layers=6, layer_types=TEXT_SMALL["layer_types"][-6:], num_attention_heads=16,
                             global_head_dim=512, num_global_key_value_heads=2)
    config = DiffusionGemmaConfig.from_hf_config(dict(text_config=text, canvas_length=256, model_type="diffusion_gemma",
                                                      architectures=["DiffusionGemmaForBlockDiffusion"]))
    params = random_inference_params(config, jax.random.key(0), jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, config.vocab_size, (2, 1000)).astype(np.int32)
    cache = dg.init_cache(config, 2, 1000 + 256, jnp.bfloat16)
    cache = dg.encode(params, prompt, cache, np.array([1000, 300], np.int32), config=config)
    canvas = rng.integers(3, config.vocab_size, (2, 256)).astype(np.int32)
    dense, _ = dg.decode(params, canvas, cache, config=config)
    for k, exact in ((1024, True), (64, False)):
        method = MAGE(k=k, exact_layers=0)
        first, _, selection = dg.decode_mage(params, canvas, cache, config=config, method=method)
        later, _, _ = dg.decode_mage(params, canvas, cache, None, selection, config=config, method=method)
        assert relative(first, np.asarray(dense)) < 2e-2 and np.isfinite(np.asarray(later)).all()
        assert (relative(later, np.asarray(dense)) < 2e-2) == exact


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(HF folder, converted folder, the float32 model loaded from the converted one): a tiny transformers
    checkpoint in the tiny tokenizer's vocabulary, canvases of 8 tokens, written with that tokenizer (no mask
    token: the model has none) and converted."""
    torch.manual_seed(1)
    text = dict(TEXT, vocab_size=VOCAB, eos_token_id=EOS)
    model = DiffusionGemmaForBlockDiffusion(HFConfig(text_config=text, vision_config=VISION, canvas_length=8))
    root = tmp_path_factory.mktemp("registry")
    model.save_pretrained(root / "hf")
    write_tiny_tokenizer(root / "hf", VOCAB, mask_token_id=None, eos_token_id=EOS)
    dllm_jax.convert_hf_checkpoint(root / "hf", root / "out", progress=False)
    return root / "hf", root / "out", dllm_jax.load_model(root / "out", dtype="float32", progress=False)


def test_the_converted_and_the_hf_folder_load_one_model(registry, rng):
    hf, _, model = registry
    direct = dllm_jax.load_model(hf, dtype="float32", progress=False)
    assert type(model) is dllm_jax.DiffusionGemma and model.config == direct.config
    assert model.config.stop_ids == (EOS,) and model.config.canvas_length == 8 and model.config.placeholder_ids == ()
    assert jax.tree.all(jax.tree.map(np.array_equal, model.params(), direct.params()))
    ids, canvas = rng.integers(0, VOCAB, (2, 5)), rng.integers(0, VOCAB, (2, 8))
    np.testing.assert_array_equal(model(ids, canvas), dg.forward(direct.params(), ids, canvas, config=direct.config))


def test_generate_runs_the_sampler_row_by_row(registry):
    """dllm_jax.generate on a left-padded batch: each row's prompt as given, then the sampler's tokens of its real
    prompt (dllm_jax.generate.diffusion_gemma.generate, same params and seed), cut to max_new_tokens."""
    _, _, model = registry
    ids = np.array([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    options = dict(max_new_tokens=12, max_denoising_steps=3, t_min=0.5, t_max=0.9)
    out = np.asarray(dllm_jax.generate(model, ids, attention_mask=mask, seed=4, **options))
    assert out.shape == (2, 5 + 12) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :5], ids)
    rows = gen.generate(model.params(), [[5, 6, 7], [9, 8, 7, 6, 5]], config=model.config,
                        options=gen.DiffusionGemmaOptions(**options), seed=4, stop_ids=(EOS,), pad_id=0)
    for got, (row, n) in zip(out, zip(rows, (3, 5))):
        want = row[n:n + 12]
        np.testing.assert_array_equal(got[5:5 + len(want)], want)
        assert (got[5 + len(want):] == 0).all()  # the pad id where the canvases stopped early


def test_progress_bar_counts_canvases(registry, capsys):
    _, _, model = registry
    ids = np.array([[5, 6, 7]], np.int32)
    options = dict(max_new_tokens=16, max_denoising_steps=2, seed=2, confidence_threshold=None)
    out = dllm_jax.generate(model, ids, progress=True, **options)
    np.testing.assert_array_equal(out, dllm_jax.generate(model, ids, **options))
    err = capsys.readouterr().err
    assert "DiffusionGemma canvases" in err and "/2" in err


class Custom(dllm_jax.Dense):
    """An attention policy of the user's own."""


@pytest.mark.parametrize("call, message", [
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), steps=4), r"unknown DiffusionGemma generate options "
                                                                            r"\['steps'\]"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), t_min=0.9), "t_max=0.8 must be above t_min=0.9"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), method="sparsed"),
     r"SparseD is a method for LLaDA models .* for DiffusionGemma use one of \['mage'\]"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), method="flashblock"),
     r"FlashBlock is a method for SDAR models .* for DiffusionGemma use one of \['mage'\]"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), method=Custom()),
     "method=Custom: DiffusionGemma's canvases attend densely or with MAGE"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), return_nfe=True), "return_nfe=True is for LLaDA"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), attention_mask=np.zeros((1, 3), np.int32)),
     "attention_mask row 0 marks no token"),
    (lambda m: dllm_jax.generate(m, np.full((1, 3), VOCAB), max_new_tokens=8), r"token ids must lie in \[0, 160\)"),
    (lambda m: dllm_jax.generate(m, np.ones((1, 3), np.int32), max_new_tokens=200_000), "exceeds the model's context"),
], ids=["unknown option", "schedule", "bidirectional method", "block method", "own policy", "nfe",
        "empty row", "token id", "context"])
def test_generate_refusals_name_the_problem(registry, call, message):
    with pytest.raises(ValueError, match=message):
        call(registry[2])


def test_int8_weights_convert_load_and_generate(registry):
    """An int8 conversion loads as the HF folder quantized at load (the same stored weights and scales), and the
    quantized model generates (bfloat16 rows through the quantized GEMMs and the grouped experts' kernel)."""
    hf, out, _ = registry
    dllm_jax.convert_hf_checkpoint(hf, out.parent / "int8", quantize="int8", progress=False)
    converted = dllm_jax.load_model(out.parent / "int8", progress=False)
    at_load = dllm_jax.load_model(hf, quantize="int8", progress=False)
    assert converted.config.quantize == at_load.config.quantize == "int8"
    layer = converted.params()["layers"][0]
    assert layer["experts_gate_up"].dtype == layer["q_proj"].dtype == np.int8
    assert converted.params()["embed"].dtype == layer["router"].dtype == np.dtype("bfloat16")  # the tied head
    assert jax.tree.all(jax.tree.map(np.array_equal, converted.params(), at_load.params()))
    out_ids = np.asarray(dllm_jax.generate(converted, np.array([[5, 6, 7]], np.int32), seed=1, **SERVED))
    assert out_ids.shape == (1, 3 + SERVED["max_new_tokens"]) and 0 <= out_ids.min() and out_ids.max() < VOCAB


@pytest.mark.parametrize("call, message", [
    (lambda hf, out: dllm_jax.load_model(out, mesh=jax.make_mesh((1,), ("tp",))),
     "DiffusionGemma weights cannot be sharded over a mesh"),
    (lambda hf, out: dllm_jax.load_model(out, execution="scan", progress=False), "runs its layers unrolled only"),
    (lambda hf, out: check_samples(dllm_jax.load_model(out, progress=False), []),
     "evaluate supports .* models, got DiffusionGemma"),
], ids=["mesh", "scan", "eval"])
def test_what_the_family_does_not_support_is_refused(registry, call, message):
    hf, out, _ = registry
    with pytest.raises(ValueError, match=message):
        call(hf, out)


def cli(argv):
    """(exit status, stdout, stderr) of `dllm-jax` with `argv`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def answer_text(model, tokenizer, prompt_ids, seed: int, **options) -> str:
    """The text of `dllm_jax.generate`'s answer to one prompt: cut after its stop id."""
    out = np.asarray(dllm_jax.generate(model, np.asarray(prompt_ids, np.int32)[None], seed=seed, **options))
    return tokenizer.decode(until_stop(out[0, len(prompt_ids):], model.config.stop_ids))


def test_the_command_line_generates_what_generate_does(registry):
    _, out, model = registry
    status, text, err = cli(["generate", "--model", str(out), "--prompt", "w5 w6 w7", "--raw", "--gen-length", "8",
                             "--steps", "2", "--t-max", "0.9", "--entropy-bound", "0.2", "--seed", "3",
                             "--dtype", "float32"])
    assert status == 0 and "[DiffusionGemma: 3 prompt tokens" in err, err
    tokenizer = ChatTokenizer(out)
    expected = answer_text(model, tokenizer, [5, 6, 7], 3, max_new_tokens=8, max_denoising_steps=2, t_max=0.9,
                           entropy_bound=0.2)
    assert text.rstrip("\n") == expected


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0.5"], "--temperature does not apply to DiffusionGemma: its sampler has no temperature"),
    (["--remasking", "random"], "--remasking random applies to LLaDA models"),
    (["--top-k", "2"], "--top-k applies to"),
    (["--t-min", "0.9"], "--t-max 0.8 must be above --t-min 0.9"),
    (["--method", "sparsed"], "for DiffusionGemma use one of ['mage']"),
])
def test_the_command_line_refuses_flags_that_do_not_apply(registry, flags, message):
    _, out, _ = registry
    status, _, err = cli(["generate", "--model", str(out), "--prompt", "w5", *flags])
    assert status == 2 and message in err, err


def test_the_server_answers_what_generate_does(registry):
    """`dllm-jax serve`'s flags for the family, and the lockstep server: each request (its own seed; every request
    samples) is answered with what `dllm_jax.generate` gives its prompt alone; a temperature is refused."""
    _, out, model = registry
    flags = argparse.Namespace(**dict.fromkeys(FLAGS.values()) | dict(gen_length=8, steps=2))
    assert family_options(flags, family_of(model)) == SERVED  # dllm-jax serve --gen-length 8 --steps 2
    status, _, err = cli(["serve", "--model", str(out), "--denoising-steps", "2"])
    assert status == 2 and "--denoising-steps does not apply to DiffusionGemma (its flags: --gen-length, --steps)" \
        in err
    tokenizer = ChatTokenizer(out)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    with running(build_app(model, tokenizer, model_name="dg", slots=2, **SERVED)) as url:
        replies = [httpx.post(url + "/v1/completions", json=dict(model="dg", prompt=prompt, max_tokens=8, seed=seed),
                              timeout=120) for prompt, seed in zip(prompts, (2, 7))]
        refused = httpx.post(url + "/v1/completions", json=dict(model="dg", prompt=[5], max_tokens=8, temperature=0.5),
                             timeout=120)
    for reply, prompt, seed in zip(replies, prompts, (2, 7)):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == answer_text(model, tokenizer, prompt, seed, **SERVED)
    assert refused.status_code == 400 and "DiffusionGemma takes no sampling values from a request" in refused.text


def test_the_lockstep_server_batches_requests_each_with_its_own_seed(registry):
    """Requests with seeds of their own share one generate batch (a key per row), each answered with what
    `dllm_jax.generate` gives its prompt alone with its seed."""
    _, out, model = registry
    prompts, seeds = [[5, 6, 7], [9, 8, 7, 6, 5], [4, 4]], (2, 7, 11)
    engine = LockstepEngine(model, slots=3, max_context=64, **SERVED)
    ids = [engine.submit(np.asarray(p, np.int32), 8, seed) for p, seed in zip(prompts, seeds)]
    done = {c.request_id: c for c in engine.step()}
    assert sorted(done) == ids and not engine.queue  # one step: one batch
    for request_id, prompt, seed in zip(ids, prompts, seeds):
        alone = np.asarray(dllm_jax.generate(model, np.asarray([prompt], np.int32), seed=seed, **SERVED))[0]
        answer = until_stop(alone[len(prompt):], model.config.stop_ids)
        np.testing.assert_array_equal(done[request_id].tokens, np.concatenate([prompt, answer]))


def test_rows_with_seeds_of_their_own_draw_what_each_draws_alone(calm, rng):
    """A seed per prompt: each row draws from its own key and generates what it does alone with that seed (and not
    what the batch's other seed gives it); a seed count that does not match the prompts is refused."""
    _, config, params = calm
    options = gen.DiffusionGemmaOptions(max_new_tokens=16, max_denoising_steps=4)
    prompts = [rng.integers(2, 128, n) for n in (6, 3)]
    together = gen.generate(params, prompts, config=config, options=options, seed=[3, 8])
    for prompt, seed, row in zip(prompts, (3, 8), together):
        np.testing.assert_array_equal(row, gen.generate(params, [prompt], config=config, options=options,
                                                        seed=seed)[0])
    assert not np.array_equal(together[0][6:], gen.generate(params, prompts, config=config, options=options,
                                                            seed=8)[0][6:])
    with pytest.raises(ValueError, match="seed holds 3 seeds for 2 prompts"):
        gen.generate(params, prompts, config=config, options=options, seed=[1, 2, 3])
