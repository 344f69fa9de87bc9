"""Training cannot lose a run: divergence, --out placement, resume checks, damaged checkpoints,
side files and flag errors. Each case was reproduced against the code before the fix; tiny models on CPU."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.eval import build_tokenizer, vocab
from dllm_jax.models import sdar
from dllm_jax.testing import write_hf_checkpoint
from dllm_jax.train import export_hf, init_params
from dllm_jax.train.__main__ import main as train_main
from dllm_jax.train.__main__ import model_config
from dllm_jax.train.run_folder import CHECKPOINTS, CONFIG_FILE, HISTORY_FILE

COMMON = ["--family", "llada", "--task", "passkey", "--context", "64", "--batch", "2", "--data-workers", "0",
          "--no-progress"]


def run_training(out, *extra, steps=4, warmup=0):
    return train_main([*COMMON, "--steps", str(steps), "--warmup", str(warmup), *extra, "--out", str(out)])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped at step 2 of 4, checkpointed at every step: resumable."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert run_training(out, "--stop-at", "2", "--checkpoint-every", "1") == 0
    return out


def copy_run(run, tmp_path):
    return shutil.copytree(run, tmp_path / "copy")


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def task_checkpoint(directory, family="sdar", seed=0):
    """An HF checkpoint over the task tokenizer (what --init takes), random weights."""
    tokenizer = build_tokenizer()
    model = model_config(family, "tiny", vocab_size=tokenizer.get_vocab_size(), special=vocab.special_ids(tokenizer),
                         max_positions=4096)
    export_hf(init_params(model, jax.random.PRNGKey(seed)), model, directory)
    build_tokenizer(directory)
    return model


# --- data loss ---

def test_a_diverging_run_stops_with_exit_2_and_keeps_the_last_finite_checkpoint_and_export(tmp_path, capsys):
    """--lr 1e4 over --stop-at + --resume: the second call's loss turns NaN; it exits 2 naming the divergence, the
    first call's finite checkpoint and hf/ export stay as they were (the old code exited 0 with NaN weights)."""
    out = tmp_path / "run"
    flags = ["--lr", "1e4", "--checkpoint-every", "1"]
    assert run_training(out, *flags, "--stop-at", "1", steps=12, warmup=1) == 0
    export = (out / "hf" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert run_training(out, *flags, "--resume", steps=12, warmup=1) == 2
    line = error_line(capsys)
    assert "training diverged" in line and "lower learning rate" in line
    assert (out / "hf" / "model.safetensors").read_bytes() == export
    model = load_model(out / "hf", dtype="float32", progress=False)
    assert np.isfinite(np.asarray(model(np.arange(3, 19).reshape(1, 16)))).all()
    kept = sorted(int(p.name) for p in (out / CHECKPOINTS).iterdir() if p.name.isdigit())
    assert kept and all(step >= 1 for step in kept)
    # every kept checkpoint is finite: resuming at a sane rate is refused only for the changed --lr
    assert run_training(out, "--lr", "1e-3", "--checkpoint-every", "1", "--resume", steps=12, warmup=1) == 2
    assert "--lr was 10000.0, now 0.001" in error_line(capsys)
    history = json.loads((out / HISTORY_FILE).read_text())["steps"]
    assert not np.isfinite(history[-1]["loss"]) or not np.isfinite(history[-1]["grad_norm"])


@pytest.mark.parametrize("where", ["out_hf_is_init", "out_is_init", "out_inside_init"])
def test_out_may_not_overlap_init(where, tmp_path, capsys):
    """--init X with --out Y where Y/hf is X, Y is X, or Y is inside X: refused before anything is written, X's
    files unchanged (the old code overwrote X's weights, config.json and recipe)."""
    init = tmp_path / "y" / "hf" if where == "out_hf_is_init" else tmp_path / "x"
    task_checkpoint(init)
    (init / CONFIG_FILE).write_text('{"recipe": "kept"}\n')
    before = {p.name: p.read_bytes() for p in init.iterdir()}
    out = {"out_hf_is_init": tmp_path / "y", "out_is_init": init, "out_inside_init": init / "sub"}[where]
    args = ["--family", "sdar", "--task", "passkey", "--context", "64", "--batch", "2", "--steps", "2",
            "--warmup", "0", "--data-workers", "0", "--no-progress", "--init", str(init), "--out", str(out)]
    assert train_main(args) == 2
    line = error_line(capsys)
    assert f"--out {out}" in line and f"--init {init}" in line
    assert {p.name: p.read_bytes() for p in init.iterdir()} == before


def test_out_inside_another_runs_tree_is_refused(stopped_run, tmp_path, capsys):
    """--out A/checkpoints/2: A's rotation would delete the new run; refused, A untouched."""
    run = copy_run(stopped_run, tmp_path)
    inside = run / CHECKPOINTS / "2"
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert run_training(inside) == 2
    assert "inside the training run" in error_line(capsys)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_out_holding_other_files_is_refused(tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "paper.txt").write_text("mine")
    assert run_training(out) == 2
    assert "not a training run's" in error_line(capsys) and (out / "paper.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["paper.txt"]


def test_export_replaces_a_stale_sharded_index(tmp_path):
    """export_hf into a folder holding a sharded checkpoint: the index and its shards go, and the loader reads the
    exported weights (the old code left the index, and load_model read the old shards)."""
    model = task_checkpoint(tmp_path / "unused")
    write_hf_checkpoint(tmp_path / "hf", model, seed=1, shards=2)
    params = init_params(model, jax.random.PRNGKey(5))
    export_hf(params, model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors*")) == ["model.safetensors"]
    loaded = load_model(tmp_path / "hf", dtype="float32", progress=False)
    ids = jnp.arange(3, 19).reshape(1, 16)
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(sdar.forward(params, ids, config=model)[0]),
                               rtol=1e-5, atol=1e-5)


# --- resume: every batch option recorded and compared ---

@pytest.mark.parametrize("change, flag", [
    (["--task", "sanity"], "--task"),
    (["--context", "128"], "--context"),
    (["--no-pad-loss"], "--no-pad-loss"),
    (["--seed", "3"], "--seed"),
    (["--min-t", "0.5"], "--min-t"),
])
def test_resume_refuses_a_changed_batch_option_by_its_flag(change, flag, stopped_run, capsys):
    assert train_main([*COMMON, "--steps", "4", "--warmup", "0", *change, "--resume",
                       "--out", str(stopped_run)]) == 2
    line = error_line(capsys)
    assert line.startswith("python -m dllm_jax.train: error: --resume:") and f"{flag} was" in line


def test_resume_refuses_changed_task_options(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--family", "llada", "--task", "niah_multikey", "--context", "64", "--batch", "2", "--steps", "3",
              "--warmup", "0", "--data-workers", "0", "--no-progress", "--checkpoint-every", "1", "--out", str(out)]
    assert train_main([*common, "--niah-needles", "1", "--stop-at", "1"]) == 0
    assert train_main([*common, "--niah-needles", "2", "--resume"]) == 2
    assert "--niah-needles was [1], now [2]" in error_line(capsys)


def test_resume_without_the_runs_config_is_refused(stopped_run, tmp_path, capsys):
    """train_config.json gone: the run's settings are unknown, so a resume (here with another --lr) is refused."""
    run = copy_run(stopped_run, tmp_path)
    (run / CONFIG_FILE).unlink()
    assert run_training(run, "--lr", "5e-3", "--resume") == 2
    assert f"{run / CONFIG_FILE} is missing" in error_line(capsys)


@pytest.mark.parametrize("name, damage", [(HISTORY_FILE, lambda text: text[: len(text) // 2]),
                                          (CONFIG_FILE, lambda text: "")])
def test_a_damaged_side_file_is_named(name, damage, stopped_run, tmp_path, capsys):
    run = copy_run(stopped_run, tmp_path)
    (run / name).write_text(damage((run / name).read_text()))
    assert run_training(run, "--resume") == 2
    assert name in error_line(capsys)


# --- damaged checkpoints ---

def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_by_name(damage, stopped_run, tmp_path, capsys):
    """Flipped bytes or a truncated data file in the latest checkpoint: exit 2 naming that checkpoint and the file,
    found by the file records before Orbax reads anything (Orbax's asynchronous reads of a damaged file leave
    tasks that print tracebacks as the process exits)."""
    run = copy_run(stopped_run, tmp_path)
    data = largest_file(run / CHECKPOINTS / "2")
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0xFF
    data.write_bytes(bytes(raw) if damage == "flip" else bytes(raw[: len(raw) // 2]))
    assert run_training(run, "--resume") == 2
    line = error_line(capsys)
    assert f"checkpoint {run / CHECKPOINTS / '2'} is damaged: " in line
    assert f"its file {data.relative_to(run / CHECKPOINTS / '2').as_posix()} " in line, line
    assert not (run / "hf" / "model.safetensors").exists() or np.isfinite(
        np.asarray(load_model(run / "hf", dtype="float32", progress=False)(np.arange(3, 19).reshape(1, 16)))).all()


# --- flags: one line naming the flag ---

@pytest.mark.parametrize("flag, value", [("--seed", "99999999999999999999"), ("--seed", "-1"), ("--batch", "0"),
                                         ("--max-minutes", "-1"), ("--lr", "nan"), ("--context", "64,0"),
                                         ("--min-t", "1"), ("--stop-at", "0")])
def test_bad_flag_values_get_argparse_one_line(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main([*COMMON, "--steps", "4", "--warmup", "0", flag, value, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    line = error_line(capsys)
    assert f"argument {flag}" in line and "BucketedSource" not in line and "max_seconds" not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, says", [(["--stop-at", "9"], "--stop-at 9 is past --steps 4"),
                                         (["--warmup", "4"], "--warmup 4 must be below --steps 4")])
def test_flag_relations_are_named_by_flag(extra, says, tmp_path, capsys):
    assert train_main([*COMMON, "--steps", "4", *(["--warmup", "0"] if "--warmup" not in extra else []), *extra,
                       "--out", str(tmp_path / "run")]) == 2
    assert says in error_line(capsys)


# --- a killed call keeps its loss records ---

def test_a_killed_call_keeps_the_loss_records_up_to_its_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dllm_jax.train", *COMMON, "--steps", "100000", "--warmup", "0",
               "--checkpoint-every", "2", "--log-every", "1", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 120
        while not (out / CHECKPOINTS / "6").is_dir() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert (out / CHECKPOINTS / "6").is_dir(), "the run made no checkpoint in time"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    steps = [r["step"] for r in json.loads((out / HISTORY_FILE).read_text())["steps"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
