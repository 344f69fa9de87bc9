"""Tokenizer path (tokenizer.json + chat template) and `dllm-jax generate`."""

import numpy as np
import pytest

from dllm_jax import convert_hf_checkpoint, load_model
from dllm_jax.cli import main
from dllm_jax.generate import generate
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer


def test_chat_template_encode_decode(tmp_path):
    write_tiny_tokenizer(tmp_path, 160, mask_token_id=150, eos_token_id=141)
    tok = ChatTokenizer(tmp_path)
    assert tok.render("w3 w7") == "<|im_start|>user\nw3 w7<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("w3 w7")
    start, user, assistant = 140, 139, 138  # <|im_start|> = EOS - 1, then the role words
    assert ids.dtype == np.int32
    assert ids.tolist() == [[start, user, 3, 7, 141, start, assistant]]
    assert tok.encode("w3 w7", chat=False).tolist() == [[3, 7]]
    assert tok.decode([3, 150, 7, 5], skip=(5,)) == "w3 w7"  # special tokens and skipped ids dropped


def test_missing_tokenizer_or_template_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        ChatTokenizer(tmp_path)
    write_tiny_tokenizer(tmp_path, 160, mask_token_id=140, eos_token_id=141, chat_template="")
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(tmp_path).encode("w1")


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_generate_command_prints_the_decoded_answer(tmp_path, capsys, family):
    if family == "llada":
        config = tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141)
        options = ["--gen-length", "8", "--steps", "4", "--block-length", "4"]
    else:
        config = tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141,), pad_token_id=141)
        options = ["--gen-length", "8", "--steps", "4", "--top-k", "1"]
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)  # the tokenizer travels with it
    assert main(["generate", "--model", str(tmp_path / "out"), "--prompt", "w1 w2 w3", "--dtype", "float32",
                 *options]) == 0
    out, err = capsys.readouterr()
    tok = ChatTokenizer(tmp_path / "out")
    model = load_model(tmp_path / "out", dtype="float32")
    ids = tok.encode("w1 w2 w3")
    api = [dict(gen_length=8, steps=4, block_length=4), dict(max_new_tokens=8, denoising_steps=4, top_k=1)]
    expected = generate(model, ids, **api[family == "sdar"])
    # at most --gen-length new tokens: SDAR decodes whole blocks (9 here), the CLI prints the first 8
    answer = np.asarray(expected)[0, ids.shape[1]:ids.shape[1] + 8]
    assert out.strip() == tok.decode(answer, skip=(150,)).strip()
    assert "prompt tokens" in err


@pytest.mark.parametrize("flags,method", [
    (["--method", "sparsed", "--select", "0.3", "--sparse-block", "16", "--skip", "0.2"],
     dict(kind="sparsed", select=0.3, block_size=16, skip=0.2)),
    (["--method", "pulsecol", "--sparsity", "0.5", "--group-size", "16", "--refreshes", "2"],
     dict(kind="pulsecol", sparsity=0.5, group_size=16, refreshes=2)),
])
def test_generate_command_with_a_sparse_method(tmp_path, capsys, flags, method):
    from dllm_jax import PulseCol, SparseD

    config = tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    options = ["--gen-length", "16", "--steps", "8", "--block-length", "8"]
    assert main(["generate", "--model", str(hf), "--prompt", "w1 w2 w3 w4", "--dtype", "float32", *options,
                 *flags]) == 0
    out, _ = capsys.readouterr()
    tok, model = ChatTokenizer(hf), load_model(hf, dtype="float32")
    ids = tok.encode("w1 w2 w3 w4")
    kind = method.pop("kind")
    config_obj = SparseD(**method) if kind == "sparsed" else PulseCol(**method)
    expected = generate(model, ids, gen_length=16, steps=8, block_length=8, method=config_obj)
    assert out.strip() == tok.decode(np.asarray(expected)[0, ids.shape[1]:], skip=(150,)).strip()


def test_method_flags_of_another_method_are_rejected(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--method", "sparsed", "--sparsity", "0.5"]) == 2
    assert "--sparsity does not apply to --method sparsed; its flags: --skip, --select, --sparse-block" in \
        capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--select", "0.5", "--eta", "1"]) == 2
    assert "--eta, --select need a sparse --method" in capsys.readouterr().err


def test_sparge_flags_build_the_policy(tmp_path, capsys):
    from dllm_jax import SpargeAttn
    from dllm_jax.analysis.calibration import Calibration, save_calibration
    from dllm_jax.cli import build_parser
    from dllm_jax.cli.methods import method_from_args

    def method(*flags):
        return method_from_args(build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags]))

    assert method("--method", "sparge") == SpargeAttn()
    assert method("--method", "sparge", "--cdfthreshd", "0.9", "--pvthreshd", "none", "--skip", "0.2") == \
        SpargeAttn(cdfthreshd=0.9, pvthreshd=None, skip=0.2)
    values = np.full((2, 4), 0.5, np.float32)
    path = tmp_path / "cal.json"
    save_calibration(path, Calibration(simthreshd1=values, cdfthreshd=values, pvthreshd=values * 20,
                                       sparsity=values, l1=values, settings=dict(block_q=32, block_kv=64)))
    loaded = method("--method", "sparge", "--calibration", str(path), "--pvthreshd", "none")
    assert loaded.block_q == 32 and loaded.pvthreshd is None and np.shape(loaded.cdfthreshd) == (2, 4)
    with pytest.raises(SystemExit):
        method("--method", "sparge", "--pvthreshd", "x")
    assert "--pvthreshd: expected float or 'none', got 'x'" in capsys.readouterr().err
