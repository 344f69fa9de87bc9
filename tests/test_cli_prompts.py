"""`dllm-jax generate` with several prompts (--prompt repeated, --prompts-file): one batched generate call
whose answers are the ones each prompt gets alone (greedy decoding), numbered, and one timing line."""

import re

import numpy as np
import pytest

from dllm_jax.cli import main
from dllm_jax.cli.generate import answer_ids
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer, left_pad

# 8, 6, 7 and 11 tokens through the chat template: left padding of 3, 5, 4 and 0; for SDAR (block 4)
# prompt blocks that end full and partial
PROMPTS = ["w1 w2 w3", "w4", "w5 w6", "w7 w8 w9 w10 w11 w12"]
OPTIONS = {"llada": ["--gen-length", "8", "--steps", "4", "--block-length", "4"],  # temperature 0: greedy
           "sdar": ["--gen-length", "8", "--steps", "4", "--top-k", "1"]}  # top-k 1: greedy


def run(capsys, model, prompt_flags, options) -> tuple[str, str]:
    assert main(["generate", "--model", str(model), "--dtype", "float32", *prompt_flags, *options]) == 0
    return capsys.readouterr()


def generated(err: str) -> int:
    """The generated-token count of a timing line."""
    return int(re.search(r"(\d+) generated", err).group(1))


def sdar_stopping_early(directory):
    """The SDAR checkpoint of `checkpoints` (same weights: same seed) with w96 a stop token as well: this
    model writes it within the first blocks for some of PROMPTS, so rows stop at different blocks."""
    config = tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141, 96), pad_token_id=141)
    return write_tiny_tokenizer(write_hf_checkpoint(directory, config), 160, mask_token_id=150, eos_token_id=141)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_several_prompts_answer_as_each_prompt_alone(checkpoints, tmp_path, capsys, family):
    model = checkpoints[0] if family == "llada" else sdar_stopping_early(tmp_path / "sdar")
    options = OPTIONS[family]
    alone = [run(capsys, model, ["--prompt", prompt], options) for prompt in PROMPTS]
    answers = [out.removesuffix("\n") for out, _ in alone]
    assert all("\n" not in answer for answer in answers)  # one line each, so the numbered lines below parse
    assert len(set(answers)) == len(PROMPTS)  # distinct answers: a row given another row's answer is seen

    out, err = run(capsys, model, [flag for prompt in PROMPTS for flag in ("--prompt", prompt)], options)
    assert out.splitlines() == [f"[{number}] {answer}" for number, answer in enumerate(answers, 1)]
    tok = ChatTokenizer(model)
    lengths = [tok.encode(prompt).shape[1] for prompt in PROMPTS]
    counts = [generated(e) for _, e in alone]
    assert lengths == [8, 6, 7, 11]
    if family == "sdar":  # the premise of sdar_stopping_early: rows that stop early and rows that do not
        assert min(counts) < 8 == max(counts)
    assert (f"4 prompts (6..11 tokens, left-padded to 11) in one batch, {sum(counts)} generated in all "
            f"({' + '.join(map(str, counts))})") in err and "tok/s" in err

    # the same prompts from a file: blank and whitespace-only lines skipped, \r\n line ends read as \n
    path = tmp_path / "prompts.txt"
    path.write_bytes(("\n" + PROMPTS[0] + "\n  \n" + "\r\n".join(PROMPTS[1:]) + "\r\n\n").encode())
    assert run(capsys, model, ["--prompts-file", str(path)], options)[0] == out


def test_prompts_are_left_padded_and_one_prompt_goes_unpadded(checkpoints):
    from dllm_jax.cli import build_parser
    from dllm_jax.cli.prompts import encode_prompts
    from dllm_jax.config import read_hf_config

    llada = str(checkpoints[0])
    _, config = read_hf_config(llada)

    def batch(*flags):
        return encode_prompts(build_parser().parse_args(["generate", "--model", llada, *flags]), config)[1]

    one = batch("--prompt", "w4")
    assert one.mask is None and one.ids.tolist() == [[140, 139, 4, 141, 140, 138]]  # generate's unbatched call
    two = batch("--raw", "--prompt", "w1 w2 w3", "--prompt", "w4")
    assert two.ids.dtype == two.mask.dtype == np.int32 and two.lengths == (3, 1)
    assert two.ids.tolist() == [[1, 2, 3], [141, 141, 4]]  # config.pad_token_id 141 on the left
    assert two.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="non-empty rows"):
        left_pad([[1, 2], []], 0)


def test_an_answer_ends_after_its_first_stop_token():
    new = np.array([3, 96, 4, 141], np.int32)
    assert answer_ids(new, (141, 96), 141, padded=True).tolist() == [3, 96]
    # batched SDAR fills a row past its end with the pad id: dropped when trailing, kept inside an answer
    assert answer_ids(np.array([9, 3, 9, 9]), (141,), 9, padded=True).tolist() == [9, 3]
    assert answer_ids(np.array([9, 3, 9, 9]), (141,), 9, padded=False).tolist() == [9, 3, 9, 9]
    assert answer_ids(np.array([9, 9]), (141,), 9, padded=True).tolist() == []


def test_fast_dllm_flags_reach_llada_generation(checkpoints, capsys):
    """--cache dual --cache-refresh 1 is exact, so the answers equal the plain run's."""
    flags = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[3]]
    plain, _ = run(capsys, checkpoints[0], flags, OPTIONS["llada"])
    cached, _ = run(capsys, checkpoints[0], flags, [*OPTIONS["llada"], "--cache", "dual", "--cache-refresh", "1"])
    assert cached == plain
    fast, _ = run(capsys, checkpoints[0], flags, [*OPTIONS["llada"], "--cache", "prefix", "--threshold", "0.9"])
    assert fast.count("\n") == plain.count("\n")  # one answer per prompt
