"""Pieces the SDAR-method tests (MAGE, FlashBlock) share: float64 masked attention and a check that
`dllm-jax generate --method ...` prints what `generate(method=...)` decodes."""

import math

import numpy as np

from dllm_jax import generate, load_model
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint

OPTIONS = dict(max_new_tokens=16, denoising_steps=4, top_k=1)


def masked_attention(q, k, v, allowed):
    """float64 softmax attention with GQA; allowed bool broadcastable to [B, Hq, Nq, Nk]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def check_generate_command(tmp_path, capsys, flags, method):
    """`dllm-jax generate` with `flags` on a tiny checkpoint prints the answer `method` generates."""
    from dllm_jax.cli import main
    from dllm_jax.testing import write_tiny_tokenizer
    from dllm_jax.tokenizer import ChatTokenizer

    config = tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141,), pad_token_id=141)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    assert main(["generate", "--model", str(hf), "--prompt", "w1 w2 w3", "--dtype", "float32", "--gen-length", "8",
                 "--steps", "4", "--top-k", "1", *flags]) == 0
    out, _ = capsys.readouterr()
    tok, model = ChatTokenizer(hf), load_model(hf, dtype="float32")
    ids = tok.encode("w1 w2 w3")
    expected = generate(model, ids, max_new_tokens=8, denoising_steps=4, top_k=1, method=method)
    assert out.strip() == tok.decode(np.asarray(expected)[0, ids.shape[1]:], skip=(150,)).strip()
