"""benchmarks/quality.py, the accuracy table of issue 19: a CPU smoke run on the shipped SDAR checkpoint and
a random tiny LLaDA, and its flag checks."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dllm_jax.eval import SPECIAL_IDS, VOCAB_SIZE, build_tokenizer
from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SDAR_TASKS = ROOT / "checkpoints" / "tiny-sdar-tasks"


def load_quality():
    """benchmarks/quality.py, imported from its file (the benchmarks are scripts, not installed)."""
    if "quality_under_test" not in sys.modules:  # its dataclasses resolve annotations through sys.modules
        spec = importlib.util.spec_from_file_location("quality_under_test", ROOT / "benchmarks" / "quality.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["quality_under_test"]


quality = load_quality()


def write_task_llada(directory: Path) -> Path:
    """A random tiny LLaDA in HF format that speaks the task tokenizer (its ids, its tokenizer.json)."""
    ids = SPECIAL_IDS
    config = tiny_llada_config(vocab_size=VOCAB_SIZE, tokenizer_vocab_size=VOCAB_SIZE, mask_token_id=ids.mask,
                               eos_token_id=ids.eos, pad_token_id=ids.pad, eot_token_id=ids.eos)
    write_hf_checkpoint(directory, config)
    build_tokenizer(directory)
    return directory


def test_quality_smoke_run_covers_every_task_and_method_asked(tmp_path):
    llada = write_task_llada(tmp_path / "tiny-llada")
    out = tmp_path / "results"
    md = quality.main(["--models", f"{SDAR_TASKS},{llada}", "--contexts", "128", "--samples", "2", "--seed", "1",
                       "--tasks", "passkey,sanity", "--methods", "dense,sparsed:defaults,dense:dual",
                       "--diagnostics", "1", "--time-repeats", "1", "--batch-size", "1", "--out", str(out),
                       "--tag", "smoke"])
    data = json.loads(md.with_suffix(".json").read_text())
    assert data["benchmark"] == "quality_smoke" and (data["samples"], data["seed"], data["batch_size"]) == (2, 1, 1)
    rows = data["rows"]
    cells = {(r["model"], r["task"], r["context"], r["method"], r["level"]) for r in rows}
    # every (task, setting) asked, for each model's family (Fast-dLLM's dual cache: LLaDA's); sanity (64-token
    # prompts) dense only
    assert cells == {("tiny-sdar-tasks", "passkey", 128, "dense", ""), ("tiny-sdar-tasks", "sanity", 64, "dense", ""),
                     ("tiny-llada", "passkey", 128, "dense", ""), ("tiny-llada", "passkey", 128, "sparsed", "defaults"),
                     ("tiny-llada", "passkey", 128, "dense", "dual"), ("tiny-llada", "sanity", 64, "dense", "")}
    assert len(rows) == len(cells)
    assert next(r for r in rows if r["method"] == "sparsed")["level"] == "defaults"  # one row of SparseD asked
    for r in rows:
        assert r["error"] is None, r
        assert 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 2  # both samples, in batches of 1
        assert r["distractor_answers"] == 0  # passkey and sanity state no distractor to take
    # the SDAR checkpoint is trained on passkey: dense retrieval at 128 tokens is a real check
    dense = next(r for r in rows if (r["model"], r["task"], r["method"]) == ("tiny-sdar-tasks", "passkey", "dense"))
    assert dense["correct"] == 2
    # diagnostics were measured for the sparse row: SparseD has both a pattern (recall) and an output error
    sparse = next(r for r in rows if r["method"] == "sparsed")
    assert sparse["diagnostics_error"] is None and 0 <= sparse["recall"] <= 1 and sparse["l1"] >= 0
    # timed warm: the speed-up is dense's time per sample over the method's, on the same model and cell
    llada_dense = next(r for r in rows if (r["model"], r["task"], r["method"], r["level"]) ==
                       ("tiny-llada", "passkey", "dense", ""))
    assert sparse["sample_seconds"] > 0 and llada_dense["sample_seconds"] > 0
    assert sparse["speedup"] == pytest.approx(llada_dense["sample_seconds"] / sparse["sample_seconds"])
    # the dual-cache row decoded through Fast-dLLM's cache (evaluate's options say so), timed against the same
    # uncached dense row
    dual = next(r for r in rows if r["level"] == "dual")
    assert dual["decoding"] == {"cache": "dual", "threshold": 0.9} and llada_dense["decoding"] is None
    assert dual["speedup"] == pytest.approx(llada_dense["sample_seconds"] / dual["sample_seconds"])
    table = md.read_text()
    assert "Speed of tiny-llada" in table and f"{sparse['speedup']:.2f}×" in table
    # the Pareto picture: one per model and context with two or more settings (the SDAR ran dense only)
    pictures = quality.main(["--plot", str(md.with_suffix(".json")), "--out", str(tmp_path / "plots")])
    assert pictures == [tmp_path / "plots" / "quality_smoke_pareto_tiny-llada_128.png"]
    assert pictures[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## tiny-sdar-tasks (SDAR)" in table and "## tiny-llada (LLaDA)" in table and "passkey@128" in table
    # runs split per model (as on a time-limited GPU) merge into the table of the single run
    parts = []
    for model in ("tiny-sdar-tasks", "tiny-llada"):
        part = dict(data, models=[model], families={model: data["families"][model]},
                    rows=[r for r in rows if r["model"] == model])
        parts.append(tmp_path / f"{model}.json")
        parts[-1].write_text(json.dumps(part))
    merged = quality.main(["--merge", ",".join(map(str, parts)), "--out", str(tmp_path / "merged"), "--tag", "smoke"])
    assert merged.read_text() == table
    assert json.loads(merged.with_suffix(".json").read_text())["rows"] == rows
    # a context run without diagnostics (as a long one within a time limit) merges, and the header says where the
    # recall and L1 columns were measured
    longer = dict(data, contexts=[256], diagnostics=0, rows=[dict(r, context=256, recall=None, l1=None) for r in rows])
    parts.append(tmp_path / "longer.json")
    parts[-1].write_text(json.dumps(longer))
    merged = quality.main(["--merge", ",".join(map(str, parts)), "--out", str(tmp_path / "merged"), "--tag", "two"])
    assert "the first 1 samples of every task at 128 tokens only (not measured at 256)" in merged.read_text()
    assert json.loads(merged.with_suffix(".json").read_text())["diagnostics_by_context"] == {"128": 1, "256": 0}


@pytest.mark.parametrize("flags, message", [
    (["--methods", "dense,quest"], "quest"),
    (["--contexts", "32"], "too short for niah_multikey"),
    (["--tasks", "passkey,ruler"], "ruler"),
    (["--seed", str(2**31)], "training seeds"),
    (["--samples", "2", "--diagnostics", "3"], "--diagnostics 3"),
    (["--methods", "sparsed"], "no --models is one"),
    (["--methods", "dense:dual"], "dense:dual serves LLaDA models"),
    (["--methods", "mage:k=ctx/1000"], "mage:k=ctx/1000"),
    (["--tasks", "passkey", "--contexts", "32"], "row mage:k=ctx/64 is invalid"),  # k = 32 // 64 = 0
    (["--contexts", "8192"], "max_position_embeddings"),
    (["--merge", "a.json"], "takes no --models"),
    (["--time-repeats", "-1"], "--time-repeats -1"),
    (["--samples", "4", "--batch-size", "5"], "--batch-size 5"),
])
def test_quality_rejects_bad_flags_before_any_model_work(flags, message, tmp_path):
    # the flags are checked from config.json alone, before any weights load or any file is written
    with pytest.raises(ValueError, match=message):
        quality.main(["--models", str(SDAR_TASKS), "--out", str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    points = [dict(name=n, speedup=x, accuracy=y) for n, x, y in
              [("dense", 1.0, 98.0), ("a", 1.5, 97.0), ("b", 1.4, 95.0), ("c", 2.0, 90.0), ("d", 1.0, 90.0)]]
    assert [p["name"] for p in quality.pareto_front(points)] == ["dense", "a", "c"]


def test_pareto_points_leave_out_a_setting_run_on_fewer_tasks_than_dense():
    def row(method, level, task, correct, speedup):
        return dict(model="m", context=4096, method=method, level=level, task=task, error=None, correct=correct,
                    n=10, speedup=speedup)

    data = dict(families={"m": "LLaDA"}, methods=["dense", "sparsed:defaults", "sparsed:select=0.2"],
                rows=[row("dense", "", "passkey", 10, None), row("dense", "", "variable_tracking", 8, None),
                      row("sparsed", "defaults", "passkey", 10, 1.2),
                      row("sparsed", "defaults", "variable_tracking", 6, 1.4),
                      row("sparsed", "select=0.2", "passkey", 10, 1.5)])  # its run was cut before the second task
    points = quality.pareto_points(data, "m", 4096)
    assert [(p["name"], p["accuracy"], p["speedup"], p["samples"]) for p in points] == [
        ("dense", 90.0, 1.0, 20), ("SparseD defaults", 80.0, pytest.approx(1.3), 20)]
