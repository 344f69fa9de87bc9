"""Dream: config, converter, the forward against transformers' Qwen2ForCausalLM, and the sampler against a
PyTorch port of the official `diffusion_generate` (tests/torch_dream.py), on tiny random models built and
saved by transformers."""

import jax
import numpy as np
import pytest
import torch

from dllm_jax import PulseCol, SpargeAttn, SparseD, generate, load_model, shipped_config
from dllm_jax.checkpoint.hf import plan_conversion
from dllm_jax.config import DreamConfig, config_from_hf
from dllm_jax.generate.dream import DreamOptions, step_uniforms, timesteps, transfer_count, transfer_ratios
from dllm_jax.models.layers import lm_param_shapes
from dllm_jax.testing import tiny_dream_config, write_hf_checkpoint
from torch_dream import dream_checkpoint, diffusion_generate, official_inputs, qwen2_logits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FP32_BOUND = 1e-4  # max |jax - torch| / max |torch| (issue 22)
MASK, EOS, VOCAB = 170, 171, 176
CONFIGS = {
    "gqa_4_2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96),
    "mha_tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                     tie_word_embeddings=True),
    "mqa_head_dim_8_theta_1e4": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                                     intermediate_size=64, rope_theta=1e4),
}


def build(directory, name, seed, layers=2):
    values = dict(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False) | CONFIGS[name]
    return dream_checkpoint(directory, seed=seed, mask_token_id=MASK, eos_token_id=EOS, **values)


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(torch Qwen2ForCausalLM, its directory) for each config."""
    directory = tmp_path_factory.mktemp(request.param)
    return build(directory, request.param, seed=len(request.param)), directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The sampler tests' pair, one GQA layer (the loops compile faster): (torch model, float32 dllm_jax model)."""
    directory = tmp_path_factory.mktemp("dream_gen")
    torch_model = build(directory, "gqa_4_2", seed=5, layers=1)
    return torch_model, load_model(directory, dtype="float32", progress=False)


def relative_error(out, ref):
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


def test_forward_matches_qwen2_with_an_all_visible_mask(pair, rng):
    torch_model, directory = pair
    model = load_model(directory, dtype="float32", progress=False)
    assert isinstance(model.config, DreamConfig)
    ids = rng.integers(0, MASK, (2, 23))
    logits = model(ids)
    assert logits.shape == (2, 23, VOCAB)
    ref = qwen2_logits(torch_model, torch.as_tensor(ids)).numpy()
    assert relative_error(logits, ref) <= FP32_BOUND
    # bf16 weights and activations: 8 mantissa bits, ~1% drift through 2 layers (as LLaDA's bound)
    assert relative_error(load_model(directory, dtype="bfloat16", progress=False)(ids), ref) <= 3e-2


def test_forward_with_padding_matches_the_official_inputs(pair, rng):
    """Left and inner padding: cumsum positions and hidden padding keys; the real positions' logits
    equal the official pairwise-mask forward's."""
    torch_model, directory = pair
    model = load_model(directory, dtype="float32", progress=False)
    ids = rng.integers(0, MASK, (3, 17))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    mask[2, [0, 1, 9]] = 0
    pairwise, tok_idx = official_inputs(torch.as_tensor(mask), 17)
    ref = qwen2_logits(torch_model, torch.as_tensor(ids), pairwise, tok_idx).numpy()
    out = np.asarray(model(ids, mask))
    real = mask.astype(bool)
    assert relative_error(out[real], ref[real]) <= FP32_BOUND


def test_shipped_configs():
    for name in ("dream-v0-instruct-7b", "dream-v0-base-7b"):
        c = shipped_config(name)
        assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                c.vocab_size) == (28, 3584, 28, 4, 128, 18944, 152064)
        assert (c.mask_token_id, c.eos_token_id, c.pad_token_id, c.rope_theta) == (151666, 151643, 151643, 1e6)
        shapes = lm_param_shapes(c)
        count = sum(int(np.prod(s)) for s in [shapes["embed"], shapes["final_norm"], shapes["lm_head"]])
        count += sum(int(np.prod(s)) for s in shapes["layers"].values())
        assert abs(count / 7.61e9 - 1) < 0.005  # Qwen2.5-7B: 7.61B parameters (its model card)


def test_config_checks():
    base = DreamConfig(**dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                              vocab_size=176, mask_token_id=170, eos_token_id=171, pad_token_id=171,
                              bos_token_id=171)).to_hf_config()
    assert config_from_hf(base) == tiny_dream_config(max_position_embeddings=131072)
    for change, message in (({"use_sliding_window": True}, "use_sliding_window"),
                            ({"rope_scaling": {"rope_type": "yarn"}}, "rope scaling"),
                            ({"hidden_act": "gelu"}, "hidden_act"), ({"head_dim": 32}, "head_dim"),
                            ({"rope_theta": None}, "rope_theta"), ({"architectures": ["Qwen2ForCausalLM"]}, "Dream"),
                            ({"mask_token_id": 171}, "mask token must be its own id")):
        with pytest.raises(ValueError, match=message):
            config_from_hf(base | change)


def test_checkpoint_problems_are_named_in_one_error(tmp_path):
    config = tiny_dream_config()
    from dllm_jax.testing import random_hf_tensors
    tensors = random_hf_tensors(config)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(60, np.float32)
    write_hf_checkpoint(tmp_path, config, tensors=tensors)
    with pytest.raises(ValueError) as error:
        plan_conversion(tmp_path, config)
    text = str(error.value)
    assert "(3 problems)" in text
    assert "model.layers.1.self_attn.k_proj.bias: missing" in text
    assert "model.layers.0.self_attn.o_proj.bias: unexpected tensor" in text
    assert "model.layers.0.self_attn.q_proj.bias: shape [60], config expects [64]" in text


def test_timesteps_are_torch_linspace_bit_for_bit():
    for eps in (1e-3, 1e-5, 1e-2, 0.1, 0.5):
        for steps in [*range(1, 400), 1024, 4096]:
            np.testing.assert_array_equal(timesteps(steps, eps), torch.linspace(1, eps, steps + 1).numpy(),
                                          err_msg=f"{steps=} {eps=}")
    ref = torch.linspace(1, 1e-3, 65)
    np.testing.assert_array_equal(transfer_ratios(64, 1e-3)[:-1], (1 - ref[1:-1] / ref[:-2]).numpy())


def test_transfer_count_is_float32_as_torch():
    """int(masked / batch * ratio) in the compiled loop's arithmetic equals torch's float32 arithmetic
    (the official `mask_index.sum() / mask_index.shape[0]` times `1 - s / t`)."""
    ratios = transfer_ratios(64, 1e-3)
    totals = np.arange(0, 4097, 3, dtype=np.int32)
    for batch in (1, 2, 3, 5, 7):
        count = jax.jit(jax.vmap(lambda t, r: transfer_count(t, batch, r, False), in_axes=(0, None)))
        for i in (0, 5, 31, 62):
            want = [int((torch.tensor(int(t)) / batch) * torch.tensor(ratios[i])) for t in totals]
            np.testing.assert_array_equal(np.asarray(count(totals, ratios[i])), want)


def port(torch_model, prompt, mask=None, draws=None, **options):
    o = DreamOptions(**options)
    return diffusion_generate(
        lambda x, pairwise, tok_idx: qwen2_logits(torch_model, x, pairwise, tok_idx), prompt, mask,
        mask_token_id=MASK, max_new_tokens=o.max_new_tokens, steps=o.steps, eps=o.eps, alg=o.alg,
        alg_temp=o.alg_temp or None, temperature=o.temperature, top_p=o.top_p if o.top_p < 1 else None,
        top_k=o.top_k or None, draws=draws)


def jax_draws(seed, batch, length):
    return lambda i: {k: np.asarray(v) for k, v in step_uniforms(seed, i, (batch, length)).items()}


GREEDY = [dict(alg=alg, max_new_tokens=12, steps=6) for alg in ("maskgit_plus", "topk_margin", "entropy")]


@pytest.mark.parametrize("options", GREEDY, ids=[o["alg"] for o in GREEDY])
def test_greedy_generation_equals_the_official_sampler(models, rng, options):
    torch_model, model = models
    prompt = rng.integers(0, MASK, (2, 9))
    np.testing.assert_array_equal(generate(model, prompt, **options), port(torch_model, prompt, **options))


SAMPLED = [dict(alg="origin", max_new_tokens=12, steps=5, temperature=0.8, top_p=0.9),
           dict(alg="origin", max_new_tokens=10, steps=4),
           dict(alg="maskgit_plus", max_new_tokens=12, steps=5, temperature=1.0, top_k=20, alg_temp=0.5),
           dict(alg="topk_margin", max_new_tokens=12, steps=12, temperature=0.5, top_p=0.95, top_k=30),
           dict(alg="entropy", max_new_tokens=12, steps=4, temperature=0.2, top_p=0.95, alg_temp=0.1)]


@pytest.mark.parametrize("options", SAMPLED, ids=[f"{o['alg']}_{i}" for i, o in enumerate(SAMPLED)])
def test_sampled_generation_equals_the_port_with_the_same_draws(models, rng, options):
    """Token draws, origin transfers and alg_temp selections from the same uniforms (torch_dream.py's
    `draws`): every other part of the official step must then give the same tokens."""
    torch_model, model = models
    prompt = rng.integers(0, MASK, (2, 7))
    length = 7 + options["max_new_tokens"]
    out = generate(model, prompt, seed=11, **options)
    # (a drawn token may be the mask id itself: the official loop then leaves that position masked)
    np.testing.assert_array_equal(out, port(torch_model, prompt, draws=jax_draws(11, 2, length), **options))


def test_padding_and_infilling_equal_the_official_sampler(models, rng):
    torch_model, model = models
    prompt = rng.integers(0, MASK, (3, 10))
    mask = np.ones_like(prompt)
    mask[1, :4] = 0
    mask[2, :7] = 0
    prompt[mask == 0] = EOS
    options = dict(alg="entropy", max_new_tokens=10, steps=5)
    np.testing.assert_array_equal(generate(model, prompt, attention_mask=mask, **options),
                                  port(torch_model, prompt, mask, **options))
    infill = rng.integers(0, MASK, (2, 12))
    infill[:, [3, 4, 8]] = MASK
    options = dict(alg="maskgit_plus", max_new_tokens=8, steps=4)
    np.testing.assert_array_equal(generate(model, infill, **options), port(torch_model, infill, **options))


def test_sampled_runs_with_the_official_torch_draws_share_the_invariants(models, rng):
    """The official torch draws cannot be replayed: the port's own sampled run (Categorical, torch.rand,
    multinomial) and ours share only invariants: the prompt kept, every answer position drawn (the last
    step draws all that remain; a draw may be the mask id itself), ids inside the vocabulary."""
    torch_model, model = models
    prompt = rng.integers(0, MASK, (2, 6))
    for options in (dict(alg="origin", max_new_tokens=10, steps=3, temperature=1.0),
                    dict(alg="maskgit_plus", max_new_tokens=10, steps=3, temperature=1.0, alg_temp=0.5)):
        for out in (generate(model, prompt, seed=1, **options), port(torch_model, prompt, **options)):
            assert out.shape == (2, 16) and out.min() >= 0 and out.max() < VOCAB
            np.testing.assert_array_equal(out[:, :6], prompt)
            assert (out[:, 6:] == MASK).mean() < 0.2


def test_sparse_methods_run_and_keeping_every_key_equals_dense(models, rng):
    _, model = models
    prompt = rng.integers(0, MASK, (1, 20))
    options = dict(alg="maskgit_plus", max_new_tokens=12, steps=4)
    dense = generate(model, prompt, **options)
    keep_all = (SparseD(select=1.0, block_size=16), PulseCol(sparsity=0.0, group_size=16, refreshes=2),
                SpargeAttn(simthreshd1=0.0, topk=1.0, pvthreshd=None, block_q=16, block_kv=16))
    for method in keep_all:  # their sparse code paths (block-sparse, column-sparse, SpargeAttn's tiles) run
        np.testing.assert_array_equal(generate(model, prompt, method=method, **options), dense)


def test_bad_requests_are_refused(models, rng):
    _, model = models
    prompt = rng.integers(0, MASK, (2, 8))
    cases = [(dict(alg="greedy"), "alg must be one of"), (dict(eps=0.0), "eps"), (dict(top_p=0.0), "top_p"),
             (dict(alg_temp=0.5), "alg_temp=0.5 applies"), (dict(top_k=999, alg="entropy"), "top_k=999 exceeds"),
             (dict(gen_length=8), "unknown Dream generate options"), (dict(method="mage"), "MAGE is a method for SDAR"),
             (dict(max_new_tokens=600), "exceeds the model's context")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(model, prompt, **options)
    uneven = prompt.copy()
    uneven[0, 2] = MASK
    with pytest.raises(ValueError, match="different numbers of mask ids"):
        generate(model, uneven)
    mask = np.ones_like(prompt)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="SparseD takes no padding mask"):
        generate(model, prompt, attention_mask=mask, method="sparsed")


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    from dllm_jax.testing import write_tiny_tokenizer

    directory = write_hf_checkpoint(tmp_path_factory.mktemp("dream_cli"), tiny_dream_config(num_layers=1))
    return str(write_tiny_tokenizer(directory, VOCAB, mask_token_id=MASK, eos_token_id=EOS))


def test_cli_generates_with_dream_flags(cli_checkpoint, capsys):
    from dllm_jax.cli import main

    flags = ["--gen-length", "8", "--steps", "4", "--remasking", "entropy", "--top-p", "0.9"]
    assert main(["generate", "--model", cli_checkpoint, "--prompt", "w5 w6 w7", *flags]) == 0
    captured = capsys.readouterr()
    assert "[Dream: " in captured.err and "8 generated" in captured.err
    for flags, message in ((["--block-length", "4"], "--block-length applies to LLaDA models; this checkpoint is Dream"),
                           (["--confidence-threshold", "0.5"], "applies to SDAR models; this checkpoint is Dream"),
                           (["--remasking", "random"], "--remasking random applies to LLaDA models"),
                           (["--method", "mage"], "MAGE is a method for SDAR models")):
        assert main(["generate", "--model", cli_checkpoint, "--prompt", "w5", *flags]) == 2
        assert message in capsys.readouterr().err
    assert main(["analyze", "--model", cli_checkpoint, "--prompt", "w5", "--method", "mage"]) == 2
    assert "MAGE is a method for SDAR models" in capsys.readouterr().err  # analyze: tests/test_analysis_families.py


@pytest.mark.gpu
def test_gpu_bf16_cudnn_and_the_sparse_kernels(tmp_path, rng):
    """On the GPU: bf16 (cuDNN attention, head_dim 128) against the fp32 torch reference, with padding; the
    Pallas kernels of the three methods in Dream's loop (fp32), keeping every key, equal dense."""
    torch_model = dream_checkpoint(tmp_path, seed=9, mask_token_id=MASK, eos_token_id=EOS, vocab_size=VOCAB,
                                   hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=512, num_hidden_layers=2, rope_theta=1e6)
    model = load_model(tmp_path, dtype="bfloat16", progress=False)
    ids = rng.integers(0, MASK, (2, 200))
    mask = np.ones_like(ids)
    mask[1, :37] = 0
    pairwise, tok_idx = official_inputs(torch.as_tensor(mask), 200)
    ref = qwen2_logits(torch_model, torch.as_tensor(ids), pairwise, tok_idx).numpy()
    assert relative_error(np.asarray(model(ids, mask))[mask == 1], ref[mask == 1]) <= 3e-2
    model = load_model(tmp_path, dtype="float32", progress=False)  # fp32: no bf16 near-ties between kernels
    prompt = rng.integers(0, MASK, (1, 96))
    options = dict(alg="maskgit_plus", max_new_tokens=32, steps=8)
    dense = generate(model, prompt, **options)
    for method in (SparseD(select=1.0), PulseCol(sparsity=0.0, group_size=32, refreshes=2),
                   SpargeAttn(simthreshd1=0.0, topk=1.0, pvthreshd=None)):
        np.testing.assert_array_equal(generate(model, prompt, method=method, **options), dense)
