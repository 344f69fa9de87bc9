"""MAGE: the prefix selection against a numpy version of the paper's Eq. 3, the sparse step against
attention under the explicit mask, and exactness when everything is kept."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import generate, load_model
from dllm_jax.attention.mage import MAGE, select_prefix
from dllm_jax.attention.policy import Mode
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def mage_numpy(q, k_cache, prefix_len, k):
    """Eq. 3: mean over the G query heads and the block's queries of softmax(q K^T / sqrt(d)) over the
    prefix + block keys; top-k prefix positions per KV head, ascending."""
    q, kc = np.asarray(q, np.float64), np.asarray(k_cache, np.float64)
    b, n, hq, d = q.shape
    hkv, total = kc.shape[2], prefix_len + n
    out = np.zeros((b, hkv, min(k, prefix_len)), int)
    for bi in range(b):
        for g in range(hkv):
            probs = []
            for h in range(g * hq // hkv, (g + 1) * hq // hkv):
                s = q[bi, :, h] @ kc[bi, :total, g].T / math.sqrt(d)
                p = np.exp(s - s.max(-1, keepdims=True))
                probs.append(p / p.sum(-1, keepdims=True))
            score = np.mean(probs, axis=(0, 1))[:prefix_len]
            out[bi, g] = np.sort(np.argsort(-score, kind="stable")[:min(k, prefix_len)])
    return out


@pytest.mark.parametrize("n,hq,hkv,prefix,k", [(4, 4, 2, 60, 8), (8, 8, 2, 100, 32), (4, 4, 4, 5, 8), (16, 4, 1, 40, 40)])
def test_select_prefix_matches_eq3(rng, n, hq, hkv, prefix, k):
    q = jnp.asarray(rng.standard_normal((2, n, hq, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, prefix + n + 7, hkv, 32)), jnp.float32)  # 7 unused slots
    got = np.asarray(select_prefix(q, cache, prefix_len=prefix, k=k))
    expected = mage_numpy(q, cache, prefix, k)
    count = min(k, prefix)
    np.testing.assert_array_equal(got[..., :count], expected)
    assert (got[..., count:] == got[..., count - 1:count]).all()  # padding repeats the last pick
    assert got.dtype == np.int32 and got.shape == (2, hkv, k)


def masked_attention(q, k, v, allowed):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def test_sparse_step_attends_to_the_selection_and_the_block(rng):
    n, hq, hkv, prefix, cap = 4, 4, 2, 50, 64
    q = jnp.asarray(rng.standard_normal((1, n, hq, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, cap, hkv, 32)), jnp.float32) for _ in range(2))
    mage = MAGE(k=8, exact_layers=0)
    kv_len = jnp.int32(prefix + n)
    out, state = mage.attend(q, k, v, (jnp.zeros((1, hkv, 8), jnp.int32), jnp.bool_(False)),
                             jnp.int32(Mode.ESTIMATE), kv_len=kv_len)
    np.testing.assert_allclose(out, masked_attention(q, k, v, np.arange(cap) < prefix + n), atol=1e-5)  # exact
    sparse, _ = mage.attend(q, k, v, state, jnp.int32(Mode.SPARSE), kv_len=kv_len)
    keep = np.zeros((1, hq, 1, cap), bool)
    for g in range(hkv):
        keep[0, g * 2:(g + 1) * 2, 0, np.asarray(state[0])[0, g]] = True
    keep[..., prefix:prefix + n] = True
    np.testing.assert_allclose(sparse, masked_attention(q, k, v, keep), atol=1e-5)


OPTIONS = dict(max_new_tokens=16, denoising_steps=4, top_k=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_sdar_config(num_layers=3)
    return load_model(write_hf_checkpoint(tmp_path_factory.mktemp("mage"), config, seed=4), dtype="float32",
                      progress=False)


def test_everything_kept_equals_dense_generation(model, rng):
    prompt = rng.integers(0, 170, (1, 10))
    dense = generate(model, prompt, **OPTIONS)
    np.testing.assert_array_equal(generate(model, prompt, method=MAGE(k=64, exact_layers=0), **OPTIONS), dense)
    np.testing.assert_array_equal(generate(model, prompt, method=MAGE(k=2, exact_layers=3), **OPTIONS), dense)


def test_small_k_runs_in_the_loop_and_interpret_matches_reference(model, rng):
    prompt = rng.integers(0, 170, (1, 14))
    method = MAGE(k=4, exact_layers=1)
    reference = generate(model, prompt, method=method, **OPTIONS)
    np.testing.assert_array_equal(
        generate(model, prompt, method=dataclasses.replace(method, backend="interpret"), **OPTIONS), reference)


def test_generate_command_with_mage(tmp_path, capsys):
    from dllm_jax.cli import main
    from dllm_jax.testing import write_tiny_tokenizer
    from dllm_jax.tokenizer import ChatTokenizer

    config = tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141,), pad_token_id=141)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    assert main(["generate", "--model", str(hf), "--prompt", "w1 w2 w3", "--dtype", "float32", "--gen-length", "8",
                 "--steps", "4", "--top-k", "1", "--method", "mage", "--mage-k", "4", "--exact-layers", "1"]) == 0
    out, _ = capsys.readouterr()
    tok, model = ChatTokenizer(hf), load_model(hf, dtype="float32")
    ids = tok.encode("w1 w2 w3")
    expected = generate(model, ids, max_new_tokens=8, denoising_steps=4, top_k=1, method=MAGE(k=4, exact_layers=1))
    assert out.strip() == tok.decode(np.asarray(expected)[0, ids.shape[1]:], skip=(150,)).strip()
