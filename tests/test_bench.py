"""The benchmark harness (one timer, one results writer) and the one random-weight scheme."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.bench import call_times, time_calls, time_carried, write_results
from dllm_jax.checkpoint.hf import hf_name, rules_for, tree_get
from dllm_jax.models.layers import lm_param_shapes
from dllm_jax.testing import random_hf_tensors, random_params, tiny_sdar_config


def counting(result=0.0):
    """fn() -> result, and the list its calls are recorded in."""
    calls = []

    def fn():
        calls.append(1)
        return jnp.float32(result)

    return fn, calls


def test_synchronised_timing_makes_warmup_plus_repeats_calls():
    fn, calls = counting()
    times = call_times(fn, repeats=3, warmup=2, burst_s=0)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert len(calls) == 5


def test_bad_timer_settings_are_refused_before_any_call():
    fn, calls = counting()
    for bad in (dict(repeats=0), dict(warmup=-1), dict(burst_s=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            call_times(fn, **bad)
    assert not calls


def test_burst_timing_sizes_its_bursts_with_one_extra_call():
    fn, calls = counting()
    times = call_times(fn, repeats=2, warmup=1, burst_s=1e-9)  # far below one call: bursts of one
    assert len(times) == 2 and len(calls) == 1 + 1 + 2
    assert time_calls(fn, repeats=3) == pytest.approx(time_calls(fn, repeats=3), abs=1.0)  # a float, not a list


def test_carried_timing_threads_the_carry_through_every_call():
    seen = []

    def step(carry):
        seen.append(carry)
        return jnp.float32(carry), carry + 1

    seconds, last = time_carried(step, 0, repeats=4, warmup=1)
    assert seen == [0, 1, 2, 3, 4] and last == 5 and seconds >= 0


def test_write_results_writes_json_and_markdown(tmp_path, capsys):
    meta = dict(benchmark="unit", device="CPU test", date="2026-01-01")
    path = write_results(tmp_path / "out", meta, [dict(n=1)], ["| n |", "|---|", "| 1 |"])
    assert path == tmp_path / "out" / "unit_CPU_test_2026-01-01.md"
    assert path.read_text() == "| n |\n|---|\n| 1 |\n" and "| 1 |" in capsys.readouterr().out
    assert json.loads(path.with_suffix(".json").read_text()) == dict(meta, rows=[dict(n=1)])


def test_device_and_host_random_weights_follow_one_scheme():
    """random_params (drawn on the device, tree layout) and random_hf_tensors (numpy, HF layout) have
    the same tree, and per weight the same distribution: norms 1 + N(0, 0.1²), embeddings N(0, 1),
    projections N(0, 1/fan_in). SDAR has every kind of weight (q/k norms, untied head)."""
    config = tiny_sdar_config(hidden_size=128, intermediate_size=256)
    params = random_params(config, jax.random.key(0), jnp.float32)
    assert jax.tree.map(lambda x: x.shape, params) == lm_param_shapes(config)  # same tree, same shapes
    hf = random_hf_tensors(config, seed=0)
    for rule in rules_for(config):
        device = np.asarray(tree_get(params, rule.path), np.float64)
        layers = range(config.num_layers) if rule.per_layer else [None]
        host = np.concatenate([hf[hf_name(rule, layer)].ravel() for layer in layers]).astype(np.float64)
        assert device.size == host.size, rule.path
        if rule.path[-1].endswith("norm"):
            expected_mean, expected_std = 1.0, 0.1
        elif rule.path == ("embed",):
            expected_mean, expected_std = 0.0, 1.0
        else:
            fan_in = hf[hf_name(rule, layers[0])].shape[-1]
            expected_mean, expected_std = 0.0, 1 / np.sqrt(fan_in)
        for values in (device, host):
            tolerance = 6 / np.sqrt(values.size)  # six standard errors
            assert abs(values.mean() - expected_mean) < tolerance * expected_std * 2, rule.path
            assert abs(values.std() / expected_std - 1) < tolerance + 0.02, rule.path


def throughput_module():
    """benchmarks/throughput.py, imported from its file (the benchmarks are scripts, not installed)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
    if "throughput_under_test" not in sys.modules:  # its dataclasses resolve annotations through sys.modules
        spec = importlib.util.spec_from_file_location("throughput_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["throughput_under_test"], path


def test_throughput_tiny_weights_section_writes_rows_against_the_copy_bandwidth(tmp_path):
    """The script's tiny path end to end (as the device runs it: a file, in its own process): asking
    for `weights` also measures the copy bandwidth; the weight bytes are every weight a forward reads
    (layers, final norm, LM head; not the embedding table), counted here from the config's dimensions."""
    import subprocess
    import sys

    _, path = throughput_module()
    done = subprocess.run([sys.executable, str(path), "--tiny", "--sections", "weights", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=path.parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = tmp_path.glob("throughput_*.json")
    data = json.loads(result.read_text())
    assert data["sections"] == ["copy", "weights"] and data["tiny"] and not data["baseline"]
    copy, *weights = data["rows"]
    assert copy["section"] == "copy" and copy["copy_tb_s"] > 0
    c = tiny_sdar_config()
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = 2 * d + d * (q + 2 * kv) + q * d + 3 * d * c.intermediate_size + 2 * c.head_dim  # + q/k norms
    expected = 2 * (c.num_layers * per_layer + d + d * c.vocab_size)  # bf16
    assert [r["tokens"] for r in weights] == [4, 32]
    for r in weights:
        assert r["section"] == "weights" and r["weight_bytes"] == expected
        assert r["fraction_of_copy"] == pytest.approx(r["tb_s"] / copy["copy_tb_s"])
        assert r["tb_s"] == pytest.approx(expected / (r["step_ms"] / 1e3) / 1e12)
        assert r["loop_tb_s"] == pytest.approx(expected / (r["loop_step_ms"] / 1e3) / 1e12)  # steps in one program
        assert r["loop_fraction_of_copy"] == pytest.approx(r["loop_tb_s"] / copy["copy_tb_s"])
    assert "Weight-reading part" in result.with_suffix(".md").read_text()
    assert done.stdout.rstrip().splitlines()[-1].startswith("| weights, 32 tokens |")  # the summary is last


def test_throughput_refuses_bad_sections_and_points_before_running():
    throughput, _ = throughput_module()
    with pytest.raises(ValueError, match="--sections.*'sdar,bogus'"):
        throughput.parse_sections("sdar,bogus")
    assert throughput.parse_sections("llada,sdar") == ["copy", "sdar", "llada"]  # bandwidth rows need the copy
    with pytest.raises(ValueError, match="--llada-runs.*'8:256'"):
        throughput.parse_points(["8:256"], "--llada-runs", 3)
    assert throughput.parse_points(["1024:1,8"], "--method-points", 2) == ((1024, (1, 8)),)


def test_markdown_table_pads_short_rows_and_aligns_columns():
    from dllm_jax.bench import markdown_table

    lines = markdown_table(["a", "b", "c"], [[1, "x", 2.5], ["error: out of memory"]], align="lr")
    assert lines == ["| a | b | c |", "|---|---:|---|", "| 1 | x | 2.5 |", "| error: out of memory | | |"]


def results_file(path, rows, **meta):
    """A results JSON as write_results writes it."""
    path.write_text(json.dumps(dict(dict(benchmark="unit", device="CPU test", jax="0", date="2026-01-01"), **meta,
                                    rows=rows)))
    return path


def test_merge_keeps_the_last_row_of_a_key_and_refuses_files_of_two_runs(tmp_path):
    from benchmarks.merging import merge

    a = results_file(tmp_path / "a.json", [dict(n=1, v="old"), dict(n=2, v="a")], seed=0)
    b = results_file(tmp_path / "b.json", [dict(n=1, v="new")], seed=0)
    report = lambda meta, rows: [f"{meta['benchmark']}: " + ", ".join(f"{r['n']}={r['v']}" for r in rows)]
    md = merge([a, b], tmp_path / "out", report=report, same=("seed",), key=lambda r: r["n"], order=lambda r: r["n"],
               changes=lambda parts: dict(benchmark="merged"))
    assert md.name == "merged_CPU_test_2026-01-01.md" and md.read_text() == "merged: 1=new, 2=a\n"
    assert json.loads(md.with_suffix(".json").read_text())["merged_from"] == ["a.json", "b.json"]
    c = results_file(tmp_path / "c.json", [], seed=1)
    with pytest.raises(ValueError, match="differ in seed"):
        merge([a, c], tmp_path / "out", report=report, same=("seed",))
    with pytest.raises(ValueError, match="--merge .*missing.json: no such file"):
        merge([a, tmp_path / "missing.json"], tmp_path / "out", report=report)


def test_compare_puts_each_point_of_both_runs_side_by_side(tmp_path):
    from benchmarks.merging import compare

    compared = {"sdar": (("batch",), "tokens_per_s", "tok/s", True), "weights": (("tokens",), "step_ms", "ms", False)}
    old = results_file(tmp_path / "old.json", [dict(section="sdar", batch=1, tokens_per_s=10.0),
                                                dict(section="weights", tokens=4, step_ms=2.0)], package="old")
    new = results_file(tmp_path / "new.json", [dict(section="sdar", batch=1, tokens_per_s=30.0),
                                                dict(section="sdar", batch=8, tokens_per_s=50.0),
                                                dict(section="weights", tokens=4, step_ms=1.0)], package="new")
    md = compare(old, new, tmp_path / "out", compared=compared, benchmark="unit_compare", title="Unit")
    table = md.read_text().splitlines()
    assert "| sdar | batch=1 | 10.00 tok/s | 30.00 tok/s | 3.00x |" in table
    assert "| weights | tokens=4 | 2.00 ms | 1.00 ms | 2.00x |" in table
    assert not any("batch=8" in line for line in table)  # measured by one run only


def test_merging_a_committed_result_rewrites_its_table(tmp_path):
    """The committed results stay readable: sdar_methods --merge of one committed file gives its Markdown back."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    committed = root / "benchmarks" / "results" / "sdar_methods_NVIDIA_H100_80GB_HBM3_2026-11-22.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.sdar_methods", "--merge", str(committed), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    (md,) = tmp_path.glob("*.md")
    assert md.read_text() == committed.with_suffix(".md").read_text()


def test_the_long_cache_table_lists_a_profiled_blocks_kernels():
    """On a GPU each mage128k row carries one traced block's kernels (`kernel_profile`); the Markdown lists them
    under the timing table (the CPU run has none: the profile is GPU-only)."""
    from benchmarks.sections import long_cache

    row = dict(section="mage128k", cache=131072, batch=1, block=4, steps=4, method="mage", config="mage()",
               block_ms=59.1, commit="fused with the next block's first step",
               profile=dict(gpu_ms=50.2, launches=6947, attention_share=0.2,
                            kernels=[dict(name="split_kv_attention", ms=8.01, launches=44),
                                     dict(name="kv_scores", ms=3.26, launches=34)]))
    text = "\n".join(long_cache.table({}, [row, dict(row, method="dense", profile=None)]))
    assert ("GPU kernels of one block, 131072 cache, batch 1, mage: 50.2 ms in 6947 launches (the block took "
            "59.1 ms)") in text
    assert "| `kv_scores` | 3.26 | 34 |" in text and text.count("GPU kernels of one block") == 1


def test_a_trace_summary_ranks_kernels_by_name_and_by_kind():
    """`summarize_trace` (what `kernel_profile` returns on a GPU): only the GPU process's kernels count; names and
    kinds (XLA's numbering dropped) ranked by time; the span runs from the first kernel's start to the last's end."""
    from dllm_jax.bench.profile import kernel_kind, summarize_trace

    assert [kernel_kind(n) for n in ("loop_add_fusion_70", "sort_358_1", "split_kv_attention", "memcpy32_post")] == [
        "loop_add_fusion", "sort", "split_kv_attention", "memcpy32_post"]
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU"))]
    kernels = [("sort_1_1", 0, 30), ("sort_2_1", 40, 30), ("split_kv_attention", 100, 50),
               ("loop_add_fusion_7", 200, 5)]
    events = meta + [dict(ph="X", pid=1, name=n, ts=t, dur=d) for n, t, d in kernels] + [
        dict(ph="X", pid=2, name="host_work", ts=0, dur=1000)]
    got = summarize_trace(events, top=2)
    assert (got["gpu_ms"], got["launches"], got["span_ms"]) == (0.115, 4, 0.205)
    assert got["attention_share"] == 50 / 115
    assert [(k["name"], k["launches"]) for k in got["kernels"]] == [("split_kv_attention", 1), ("sort_1_1", 1)]
    assert [(k["name"], k["ms"], k["launches"]) for k in got["kinds"]] == [
        ("sort", 0.06, 2), ("split_kv_attention", 0.05, 1), ("loop_add_fusion", 0.005, 1)]
    assert summarize_trace(meta) is None


def test_the_long_cache_byte_ideal_counts_the_prefix_reads_each_method_makes():
    """`block_modes` follows the loop's schedule (FlashBlock(tau=2) at one token per step: the modes
    tests/test_flashblock.py reads off the real loop, the commit first); `block_bytes` reads the whole prefix per
    layer in every segment that is not SPARSE and in every segment of an exact layer (MAGE at 36 layers, 2 exact:
    44 whole-prefix reads per block, the 44 split-KV launches of its profiled 8B block), the selection otherwise."""
    from benchmarks.sections.long_cache import block_bytes, block_modes
    from dllm_jax.attention.flashblock import FlashBlock
    from dllm_jax.attention.mage import MAGE
    from dllm_jax.attention.policy import Dense, Mode
    from dllm_jax.testing import tiny_sdar_config

    assert block_modes(FlashBlock(tau=2), 4) == [Mode.DENSE, Mode.ESTIMATE, Mode.SPARSE, Mode.REFRESH, Mode.SPARSE]
    assert block_modes(MAGE(), 4) == [Mode.SPARSE, Mode.ESTIMATE, Mode.SPARSE, Mode.SPARSE, Mode.SPARSE]
    config = tiny_sdar_config(num_layers=36)
    layer = 2 * config.num_kv_heads * config.head_dim * 2  # K and V of one position in one layer, bf16
    n, prefix, weights = config.block_size, 1000, 10**6

    def ideal(policy):
        return block_bytes(policy, config, batch=2, prefix=prefix, steps=4, forwards=4, weights=weights)

    assert ideal(Dense()) == 4 * weights + 2 * 36 * 5 * prefix * layer
    assert ideal(MAGE(k=64, exact_layers=2)) == 4 * weights + 2 * layer * (44 * prefix + 34 * 4 * (64 + n))
    assert ideal(FlashBlock(tau=2)) == 4 * weights + 2 * layer * 36 * (3 * prefix + 2 * n)  # SPARSE: the block
    assert ideal(FlashBlock(tau=2, inner=MAGE(k=64, exact_layers=2))) == 4 * weights + 2 * layer * (
        (2 * 5 + 34 * 3) * prefix + 34 * 2 * (64 + n))


def test_serving_plot_draws_a_results_file_and_refuses_other_files(tmp_path):
    from benchmarks import serving

    rows = [dict(rate=rate, mode=mode, tokens_per_s=tps, first_p50=0.1 * k, first_p99=0.2 * k, latency_p50=1.0 * k,
                 latency_p99=2.0 * k) for k, (rate, mode, tps) in enumerate(
                     [(4.0, "server", 800.0), (4.0, "lockstep", 700.0), (16.0, "server", 1100.0),
                      (16.0, "lockstep", 900.0)], start=1)]
    results = tmp_path / "serving_x_dev_2026-01-01.json"
    results.write_text(json.dumps(dict(benchmark="serving_x", model="tiny-sdar", slots=4, device="dev",
                                       date="2026-01-01", rows=rows)))
    png = serving.main(["--plot", str(results), "--out", str(tmp_path / "images")])
    assert png == tmp_path / "images" / "serving_x_dev_2026-01-01.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "throughput.json"
    other.write_text(json.dumps(dict(benchmark="throughput", rows=rows)))
    with pytest.raises(ValueError, match="not a results file of benchmarks/serving.py"):
        serving.main(["--plot", str(other), "--out", str(tmp_path)])


def test_serving_step_times_an_engine_step_and_a_lockstep_block(tmp_path):
    """benchmarks/serving_step.py on a tiny model (CPU: no kernel tables): both rows, every slot busy throughout."""
    from benchmarks import serving_step

    md = serving_step.main(["--model", "tiny-sdar", "--slots", "2", "--prompt-lengths", "8:32", "--steps", "2",
                            "--profile-steps", "2", "--out", str(tmp_path)])
    result = json.loads(md.with_suffix(".json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["engine step", "lockstep block"]
    assert all(r["wall_ms"] > 0 for r in result["rows"]) and result["rows"][0]["jitted_ms"] > 0
    assert "| engine step |" in md.read_text() and len(result["prompt_lengths"]) == 2


def test_serving_step_compares_kernels_per_block_and_by_class():
    """The lockstep block's kernels: the longer call's less the shorter's, per block (a kernel of only one call
    counts too); kernels fall into attention, matrix products and the rest."""
    from benchmarks.serving_step import kernel_classes, per_block

    long = [dict(name="split_kv_attention", ms=10.0, launches=40), dict(name="gemm_fusion_dot_3", ms=6.0, launches=20),
            dict(name="loop_add_fusion", ms=1.0, launches=8)]
    short = [dict(name="split_kv_attention", ms=2.0, launches=8), dict(name="cudnn_sdpa_prefill", ms=4.0, launches=1)]
    kernels = per_block(long, short, blocks=4)
    assert kernels[0] == dict(name="split_kv_attention", ms=2.0, launches=8.0)
    assert {k["name"]: k["ms"] for k in kernels} == {"split_kv_attention": 2.0, "gemm_fusion_dot_3": 1.5,
                                                     "loop_add_fusion": 0.25, "cudnn_sdpa_prefill": -1.0}
    classes = kernel_classes(long + [dict(name="nvjet_sm90_tss_64x128", ms=2.0, launches=4)])
    assert classes == {"attention": [10.0, 40], "matmul": [8.0, 24], "other": [1.0, 8]}


def test_a_long_context_trace_is_served_with_and_without_its_long_prompts(tmp_path):
    """--long-prompts: the trace's long requests sit evenly spaced among the short ones; the server serves the trace
    with them and without them, and reports the short requests' inter-block gaps both times."""
    from benchmarks import serving

    trace = serving.make_trace(50.0, 6, (8, 16), (8, 12), 192 - 3, 180, 0, long=2, long_lengths=(60, 70))
    assert [i for i, r in enumerate(trace) if len(r.prompt) > 16] == [2, 4]
    assert all(60 <= len(r.prompt) <= 70 for r in (trace[2], trace[4]))
    md = serving.main(["--model", "tiny-sdar", "--rates", "50", "--requests", "6", "--slots", "2", "--prompt-lengths",
                       "8:16", "--output-lengths", "8:12", "--seconds", "120", "--out", str(tmp_path),
                       "--long-prompts", "2", "--long-lengths", "60:70", "--clients", "thread"])
    result = json.loads(md.with_suffix(".json").read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert sorted(rows) == ["server overlapped, by forward", "server overlapped, by forward, without the long prompts"]
    assert rows["server overlapped, by forward"]["requests"] == 6 and len(result["long_prompts"]) == 2
    assert rows["server overlapped, by forward, without the long prompts"]["requests"] == 4
    # outputs of 8+ tokens: 2+ blocks each (a gap may round to 0: blocks of one step stream together)
    assert all(r["gap_p99"] is not None and 0 <= r["gap_p50"] <= r["gap_p99"] for r in rows.values())


def test_serving_runs_a_trace_with_its_clients_in_a_process_of_their_own(tmp_path):
    """benchmarks/serving.py on a tiny model (CPU): the server (without and with a prefix cache), driven by a
    client process, one request per prefill, and lockstep serve the same trace of shared-prefix traffic;
    each request gets exactly its output length (stops off); the prefix cache finds the shared prefixes."""
    from benchmarks import serving

    argv = ["--model", "tiny-sdar", "--rates", "50", "--requests", "6", "--slots", "2", "--prompt-lengths", "8:40",
            "--output-lengths", "4:12", "--seconds", "120", "--out", str(tmp_path), "--schedules", "forward",
            "--shared-prefixes", "1", "--prefix-lengths", "16:24", "--shared-fraction", "0.9",
            "--prefix-cache-mb", "0,1", "--prefill-batch", "1"]
    md = serving.main(argv)
    result = json.loads(md.with_suffix(".json").read_text())
    assert result["clients"] == "process"
    assert sorted(r["mode"] for r in result["rows"]) == [
        "lockstep", "server overlapped, by forward, prefill batch 1",
        "server overlapped, by forward, prefix cache 1 MB, prefill batch 1"]
    # tiny-sdar: vocabulary 192, mask 180
    shared = serving.shared_prefixes(1, (16, 24), 192 - 3, 0)
    trace = serving.make_trace(50.0, 6, (8, 40), (4, 12), 192 - 3, 180, 0, shared, 0.9)
    assert all(r["requests"] == 6 and r["tokens"] == sum(t.output for t in trace) for r in result["rows"])
    assert sum(len(t.prompt) > 40 for t in trace) >= 2  # requests that start with the shared prefix
    cached = [r for r in result["rows"] if "prefix cache" in r["mode"]]
    assert cached and all(r["prefix_hit_tokens"] >= len(shared[0]) // 4 * 4 for r in cached)
    assert "in a process of their own" in md.read_text()
