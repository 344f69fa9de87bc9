"""`dllm-jax` hardening: prompts files streamed in bounded batches, eval's checks before any work (its memory
among them), bench results that never replace one another, LLaDA/Dream steps bounded by the tokens they
unmask, side files written whole (dllm_jax.files.write_atomic) and only ever as regular files (never over a
device, a FIFO or a directory; through a link to its target), prompts that are not UTF-8, analyze without
matplotlib. Each refusal is one line naming the flag or the file."""

import json
import os
import re
import socket
import stat
import subprocess
import sys

import pytest

from dllm_jax.cli import main
from dllm_jax.cli.common import write_files
from dllm_jax.files import write_atomic
from dllm_jax.eval import build_tokenizer
from dllm_jax.generate import DreamOptions, LLaDAOptions
from dllm_jax.testing import tiny_dream_config, tiny_llada_config, tiny_sdar_config
from dllm_jax.tokenizer import ChatTokenizer

GREEDY = ["--gen-length", "4", "--steps", "4", "--block-length", "4", "--dtype", "float32"]  # LLaDA at T = 0


def refusal(capsys, argv) -> str:
    """The one stderr line of a refused command (exit status 2)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def config_only(directory, config) -> str:
    """A checkpoint directory with config.json only: a check that needs more would fail differently."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    return str(directory)


def generate(capsys, model, *flags) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr timing lines) of a generate run that succeeds."""
    assert main(["generate", "--model", str(model), *GREEDY, *flags]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), [line for line in err.splitlines() if line.startswith("[LLaDA")]


def test_a_prompts_file_is_streamed_in_bounded_batches_with_the_answers_of_one_batch(checkpoints, tmp_path, capsys):
    """Finding 1: --batch-size 1 gives every prompt the answer of the default batch (greedy), numbered across
    the file, one timing line per batch; a BOM is dropped, \\r\\n ends a line; the default batch is bounded."""
    llada = checkpoints[0]
    prompts = ["w1 w2 w3", "w4", "w5 w6"]
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\n".join(prompts).encode() + b"\n")  # BOM, CRLF, a blank line
    batched, one_line = generate(capsys, llada, "--prompts-file", str(path))
    assert len(batched) == 3 and len(one_line) == 1 and "3 prompts (" in one_line[0] and "in one batch" in one_line[0]
    flags = [flag for prompt in prompts for flag in ("--prompt", prompt)]
    assert generate(capsys, llada, *flags)[0] == batched  # the BOM is no token of prompt 1
    alone, lines = generate(capsys, llada, "--prompts-file", str(path), "--batch-size", "1")
    assert alone == batched and [line.split(":")[1].strip() for line in lines] == ["prompt 1", "prompt 2", "prompt 3"]
    lengths = [ChatTokenizer(llada).encode(prompt).shape[1] for prompt in prompts]
    assert [int(re.search(r"(\d+) prompt tokens", line).group(1)) for line in lines] == lengths

    many = tmp_path / "many.txt"  # more prompts than the default batch's ceiling (64): two batches
    many.write_text("w7 w8\n" * 65)
    out, lines = generate(capsys, llada, "--prompts-file", str(many))
    answer = out[0].split("] ", 1)[1]
    assert out == [f"[{n}] {answer}" for n in range(1, 66)]
    assert [line.split(":")[1].strip() for line in lines] == ["prompts 1..64", "prompt 65"]

    # batches run as the file is read: the answers before a bad line are printed, then one line names it
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"w1 w2 w3\nw4\nw5 \xff\n")
    assert main(["generate", "--model", str(llada), *GREEDY, "--prompts-file", str(bad), "--batch-size", "2"]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == batched[:2]
    assert err.strip().splitlines()[-1] == f"dllm-jax generate: error: --prompts-file {bad} is not UTF-8 text " \
                                           "(invalid start byte at byte 15)"


def test_batches_follow_the_rule_and_keep_a_multiple_of_the_data_parallel_rows():
    """Finding 1, the batching alone: a batch ends where `fits` (rows, longest prompt) says, a longer prompt
    starting the next; a full batch keeps a multiple of `multiple` rows; no prompt is read past a full batch
    before it is returned; an error item is raised before the batch it would join, after the full ones."""
    import numpy as np

    from dllm_jax.cli.prompt_stream import Prompt, prompt_batches

    def items(*lengths):
        return [(Prompt(n, None, "x"), np.zeros((1, length), np.int32)) for n, length in enumerate(lengths, 1)]

    def numbers(batches):
        return [[p.number for p, _ in rows] for rows in batches]

    fits = lambda rows, longest: rows * longest <= 12  # noqa: E731 (a memory rule in miniature)
    assert numbers(prompt_batches(items(2, 2, 2, 5, 2, 3), fits)) == [[1, 2, 3], [4, 5], [6]]
    assert numbers(prompt_batches(items(2, 2, 2, 2, 2, 2, 2), fits, multiple=4)) == [[1, 2, 3, 4], [5, 6, 7]]
    # 3 rows of 4 fit, cut to 2 each time; the last batch is what is left (generate refuses it unless dp divides it)
    assert numbers(prompt_batches(items(4, 4, 4, 4, 4), fits, multiple=2)) == [[1, 2], [3, 4], [5]]
    assert numbers(prompt_batches(items(2, 2, 4, 4), fits, multiple=2)) == [[1, 2], [3, 4]]  # 3 fit, 4 is longer

    read = []
    batches = prompt_batches((read.append(item) or item for item in [*items(2, 2, 2), ValueError("line 4")]),
                             lambda rows, longest: rows <= 2)
    assert numbers([next(batches)]) == [[1, 2]] and len(read) == 2  # returned before prompt 3 is read
    with pytest.raises(ValueError, match="line 4"):  # it would join prompt 3's batch: raised before that runs
        next(batches)


def test_a_lone_carriage_return_in_a_prompts_file_is_refused_by_line(tmp_path, capsys):
    model = config_only(tmp_path / "llada", tiny_llada_config())  # refused before the tokenizer is needed
    path = tmp_path / "mac.txt"
    path.write_bytes(b"w1 w2\rw3 w4\r")
    assert refusal(capsys, ["generate", "--model", model, "--prompts-file", str(path)]) == (
        f"dllm-jax generate: error: --prompts-file {path} line 1 holds a carriage return (\\r) that ends no line: "
        "lines end with \\n or \\r\\n; convert old Mac line ends (\\r) to \\n")


def test_a_prompts_file_that_cannot_be_opened_is_named_by_its_flag(tmp_path, capsys):
    model = config_only(tmp_path / "llada", tiny_llada_config())
    for path, reason in ((tmp_path, "Is a directory"), (tmp_path / "missing.txt", "No such file or directory")):
        assert refusal(capsys, ["generate", "--model", model, "--prompts-file", str(path)]) == (
            f"dllm-jax generate: error: --prompts-file {path} cannot be opened: {reason}")


def test_an_endless_prompts_file_ends_in_one_line_naming_it(tmp_path):
    """Finding 1: /dev/zero has no line end; its first line stops at the cap (256 bytes per position of the
    model's context of 256), long before the memory fills."""
    model = config_only(tmp_path / "llada", tiny_llada_config())
    done = subprocess.run([sys.executable, "-m", "dllm_jax.cli", "generate", "--model", model, "--prompts-file",
                           "/dev/zero"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "dllm-jax generate: error: --prompts-file /dev/zero line 1 is longer than 65,536 bytes, more than a prompt "
        "the model's context can hold: one prompt per line"]


def test_eval_checks_context_samples_and_output_before_any_work(tmp_path, capsys):
    """Finding 2: refused from config.json alone (the directory has no tokenizer and no weights)."""
    model = config_only(tmp_path / "llada", tiny_llada_config())  # 256 positions
    run = ["eval", "--model", model, "--task", "passkey"]
    line = refusal(capsys, [*run, "--context", "50000000"])
    assert line.startswith("dllm-jax eval: error: --context 50000000 + 6 answer tokens = 50000006 positions exceeds "
                           "the model's context of 256 (config.json max_position_embeddings): pass --context <= 250")
    line = refusal(capsys, [*run, "--context", "8"])
    assert line.startswith("dllm-jax eval: error: --context 8 is too short for --task passkey")
    line = refusal(capsys, [*run, "--context", "128", "--samples", "2000000000"])
    assert line.startswith("dllm-jax eval: error: --samples 2000000000 exceeds 100,000")
    longer = config_only(tmp_path / "long", tiny_llada_config(max_position_embeddings=8192))
    line = refusal(capsys, ["eval", "--model", longer, "--task", "passkey", "--context", "8000", "--samples", "40000"])
    assert line.startswith("dllm-jax eval: error: --samples 40000 x 8000 prompt tokens (--context 8000) = "
                           "320,000,000 tokens exceeds the 268,435,456 one eval holds in memory")
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    line = refusal(capsys, [*run, "--context", "128", "--json", str(blocker / "out.json")])
    assert line == f"dllm-jax eval: error: --json {blocker / 'out.json'} cannot be written: {blocker} is a file, " \
                   "not a directory"
    line = refusal(capsys, [*run, "--context", "128", "--json", str(tmp_path)])
    assert line == f"dllm-jax eval: error: --json {tmp_path} is a directory: name the file to write"


def test_bench_twice_into_one_directory_keeps_both_results(tmp_path, capsys):
    """Finding 3: the second run of the day takes the next free name; the first run's files are untouched."""
    argv = ["bench", "--sections", "attention", "--lengths", "128", "--densities", "0.5", "--heads", "1",
            "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    (first,) = tmp_path.glob("bench_*.json")
    content = first.read_bytes()
    assert main(argv) == 0
    capsys.readouterr()
    results = sorted(tmp_path.iterdir())
    assert [p.name for p in results] == [first.name, first.with_suffix(".md").name,
                                         f"{first.stem}_2.json", f"{first.stem}_2.md"]
    assert first.read_bytes() == content and json.loads((tmp_path / f"{first.stem}_2.json").read_text())["rows"]


def test_steps_above_the_tokens_they_unmask_are_refused(tmp_path, capsys):
    """Finding 4: LLaDA (and Dream) run a full forward per step; steps past gen_length unmask nothing."""
    LLaDAOptions(gen_length=8, steps=8, block_length=4)  # one token a step: accepted
    with pytest.raises(ValueError, match=r"steps=9 exceeds gen_length=8: .* pass steps <= 8"):
        LLaDAOptions(gen_length=8, steps=9, block_length=8)
    with pytest.raises(ValueError, match=r"steps=1000000000 exceeds gen_length=8"):
        LLaDAOptions(gen_length=8, steps=10**9, block_length=8)
    with pytest.raises(ValueError, match=r"steps=9 exceeds max_new_tokens=8"):
        DreamOptions(max_new_tokens=8, steps=9)
    model = config_only(tmp_path / "llada", tiny_llada_config())
    line = refusal(capsys, ["generate", "--model", model, "--prompt", "w1", "--gen-length", "8", "--steps",
                            "1000000000", "--block-length", "8"])
    assert line.startswith("dllm-jax generate: error: --steps 1000000000 exceeds --gen-length 8")


@pytest.mark.parametrize("family,flags,expected", [
    ("llada", ["--gen-length", "10", "--block-length", "4"], "--gen-length 10 must be a multiple of --block-length 4"),
    ("llada", ["--gen-length", "8", "--block-length", "4", "--steps", "3"],
     "--steps 3 must be a multiple of the number of blocks (--gen-length / --block-length = 2)"),
    ("llada", ["--threshold", "0.5", "--factor", "1"], "--threshold 0.5 and --factor 1.0 are two parallel-decoding"),
    ("llada", ["--cache", "prefix", "--cfg-scale", "1"], "--cfg-scale > 0 is not supported with --cache, --threshold"),
    ("dream", ["--alg-temp", "0.5"], "--alg-temp 0.5 applies to the confidence-based algs (maskgit_plus, "
     "topk_margin, entropy); --remasking 'origin' commits random positions"),
    ("sdar", ["--top-k", "100000"], "--top-k 100000 exceeds the model's vocabulary of 192 tokens"),
    ("dream", ["--top-k", "100000"], "--top-k 100000 exceeds the model's vocabulary of 176 tokens"),
])
def test_generate_options_errors_name_the_flags(tmp_path, capsys, family, flags, expected):
    """Also asked: messages name flags, not generate's fields (gen_length=, cache_refresh=, ...); --top-k
    against the vocabulary is refused from config.json, not after the weights load."""
    configs = {"llada": tiny_llada_config, "sdar": tiny_sdar_config, "dream": tiny_dream_config}
    model = config_only(tmp_path / family, configs[family]())
    line = refusal(capsys, ["generate", "--model", model, "--prompt", "w1", *flags])
    assert line.startswith(f"dllm-jax generate: error: {expected}"), line


def test_side_files_are_replaced_whole_never_written_in_place(tmp_path):
    """Finding 5: build_tokenizer and the CLI's write_files go through write_atomic: a name replaced by a
    rename leaves a file hard-linked to the old one as it was (a write in place would change both)."""
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f"old-{name}").write_text("old")
        os.link(tmp_path / f"old-{name}", directory / name)
    build_tokenizer(directory)
    assert [(tmp_path / f"old-{name}").read_text() for name in ("tokenizer.json", "tokenizer_config.json")] == \
        ["old", "old"]
    assert json.loads((directory / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"
    assert ChatTokenizer(directory).encode("the pass key", chat=False).shape == (1, 3)

    (tmp_path / "old-summary").write_text("old")
    os.link(tmp_path / "old-summary", directory / "summary.json")
    write_files(directory, {"summary.json": b"{}\n"})
    assert (tmp_path / "old-summary").read_text() == "old" and (directory / "summary.json").read_bytes() == b"{}\n"
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no temporary left behind


def special_file(directory, kind: str):
    """A node of `kind` made in `directory` (never a system one: a writer that wrongly replaced it would replace
    only this): a character device like /dev/full (needs root; skipped without), a FIFO, a socket or a directory."""
    path = directory / kind.replace(" ", "-")
    if kind == "character device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
        except PermissionError:
            pytest.skip("making a device node needs root")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.close()
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["character device", "FIFO", "socket", "directory"])
def test_the_results_writer_refuses_anything_but_a_regular_file(tmp_path, kind):
    target = special_file(tmp_path, kind)
    before = os.lstat(target)
    with pytest.raises(ValueError, match=f"is a {kind}.*results are written only as a regular file"):
        write_atomic(target, "{}\n")
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_the_results_writer_writes_through_a_link_to_its_target(tmp_path):
    """The link stays a link and reads the new content; its target is replaced whole (a rename beside it); a link
    to a device is refused like the device."""
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "run.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert write_atomic(link, "new") == target
    assert link.is_symlink() and link.read_text() == "new" and target.read_text() == "new"
    dangling = tmp_path / "next.json"
    dangling.symlink_to(tmp_path / "results" / "next.json")
    write_atomic(dangling, "first")
    assert dangling.is_symlink() and (tmp_path / "results" / "next.json").read_text() == "first"
    fifo = special_file(tmp_path / "results", "FIFO")
    (tmp_path / "pipe.json").symlink_to(fifo)
    with pytest.raises(ValueError, match=f"{fifo} \\(the target of the link .*pipe.json\\) is a FIFO"):
        write_atomic(tmp_path / "pipe.json", "x")
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["FIFO", "next.json", "run.json"]


def test_eval_refuses_a_json_path_that_is_not_a_file_before_any_work(tmp_path, capsys):
    """Refused from config.json alone: the directory has no tokenizer and no weights, so a check that came later
    would fail on those instead."""
    model = config_only(tmp_path / "llada", tiny_llada_config())
    run = ["eval", "--model", model, "--task", "passkey", "--context", "128", "--samples", "2"]
    fifo = special_file(tmp_path, "FIFO")
    (tmp_path / "link").symlink_to(fifo)
    for path in (fifo, tmp_path / "link", special_file(tmp_path, "socket")):
        line = refusal(capsys, [*run, "--json", str(path)])
        assert line.startswith("dllm-jax eval: error: --json: ") and "results are written only as a regular" in line
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "link").is_symlink()


def test_a_prompt_whose_bytes_are_not_utf8_is_one_line(checkpoints, capsys):
    """What a shell passes for $'w5 \\xff': Python decodes argv with surrogateescape, so the prompt holds U+DCFF."""
    line = refusal(capsys, ["generate", "--model", str(checkpoints[1]), "--prompt", "w5 \udcff", "--gen-length", "4"])
    assert line == ("dllm-jax generate: error: the prompt is not valid UTF-8 text: U+DCFF at character 3 is a lone "
                    "surrogate (an undecodable byte, or half of a UTF-16 pair)")


def test_analyze_without_matplotlib_says_what_to_install(checkpoints, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    line = refusal(capsys, ["analyze", "--model", str(checkpoints[0]), "--prompt", "w5", "--method", "sparsed"])
    assert line == ("dllm-jax analyze: error: analyze draws its plots with matplotlib, which is not installed: pip "
                    "install 'dllm-jax[analysis]'")


def test_an_eval_batch_that_cannot_fit_in_memory_is_refused_before_any_work(tmp_path, capsys):
    """On the CPU one layer's attention scores [batch, heads, positions, positions] alone pass any machine's
    memory here (about 1.6 TB); the run would otherwise be killed by the kernel with no message."""
    model = config_only(tmp_path / "llada", tiny_llada_config(max_position_embeddings=2048))
    line = refusal(capsys, ["eval", "--model", model, "--task", "passkey", "--context", "1024",
                            "--samples", "100000", "--batch-size", "100000"])
    assert line.startswith("dllm-jax eval: error: --batch-size 100000 at 1030 positions (--context 1024 and the "
                           "answer) needs at least ") and "GiB is free besides the weights" in line, line
