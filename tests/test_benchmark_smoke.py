"""The benchmarks' CPU checks run as their docstrings print them (at the smallest sizes): each writes its results
file, and what it measures holds on the tiny configs (a sweep of sampling values compiles nothing; quantized
logits stay close to bf16's)."""

import json

import pytest

from benchmarks import compile_once, diffusion_gemma, quantization


def results(out, stem: str) -> dict:
    (path,) = out.glob(f"{stem}_*.json")
    assert path.with_suffix(".md").is_file()
    return json.loads(path.read_text())


def test_compile_once_on_the_tiny_sdar(tmp_path):
    compile_once.main(["--tiny", "--cases", "sdar-b1", "--second", "sdar-b1", "--repeats", "1", "--out", str(tmp_path)])
    (row,) = results(tmp_path, "compile_once_tiny")["rows"]
    assert row["sweep_compile_events"] == 0 and len(row["sweep_s"]) == len(compile_once.SDAR_SWEEP)
    assert row["traced_tokens_per_s"] > 0 and row["static_tokens_per_s"] > 0
    assert "second_process" in row, row.get("second_process_error")


def test_quantization_shapes_on_the_tiny_configs(tmp_path):
    quantization.main(["--tiny", "--parts", "shapes", "--modes", "int8", "--tokens", "64", "--out", str(tmp_path)])
    rows = results(tmp_path, "quantization")["rows"]
    int8 = [r for r in rows if r["quantize"] == "int8"]
    assert int8 and all(r["logits_rel_error"] < 0.05 and r["argmax_agreement"] > 0.9 for r in int8), int8


def test_diffusion_gemma_against_transformers_on_a_small_stand_in(tmp_path):
    diffusion_gemma.main(["--small", "--layers", "2", "--points", "1:24:16", "--steps", "2", "--profile",
                          "--mage-contexts", "48", "--mage-k", "8", "--out", str(tmp_path)])
    rows = results(tmp_path, "diffusion_gemma")["rows"]
    assert [r["side"] for r in rows] == ["transformers", "dllm_jax", "canvas step"]
    assert all(0 < r["tokens"] <= 16 for r in rows[:2])  # a row may stop at a random EOS
    assert rows[1]["vs_transformers"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert "kernels" in rows[1]  # None on a CPU: the trace holds no GPU kernels
    step = rows[2]
    assert (step["context"], step["steps"], step["k"]) == (48, 2, 8)
    assert step["speedup"] == pytest.approx(step["dense_ms"] / step["mage_ms"])
    assert "| 48 | 2 | 8 |" in next(tmp_path.glob("diffusion_gemma_*.md")).read_text()


def test_the_transformers_side_is_built_in_bf16_with_the_constructors_buffers_and_tied_weights():
    import argparse

    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    config = lambda: DiffusionGemmaConfig(  # noqa: E731
        text_config=diffusion_gemma.text_config(argparse.Namespace(small=True, layers=2)),
        vision_config=diffusion_gemma.VISION)
    built = diffusion_gemma.transformers_model(DiffusionGemmaForBlockDiffusion, config(), "cpu")
    usual = DiffusionGemmaForBlockDiffusion._from_config(config(), dtype=torch.bfloat16)
    buffers = dict(usual.named_buffers())
    assert {name for name, _ in built.named_buffers()} == buffers.keys()
    for name, buffer in built.named_buffers():
        torch.testing.assert_close(buffer.float(), buffers[name].float(), rtol=0, atol=0, msg=name)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in usual.parameters())  # tied
    assert all(torch.isfinite(p.float()).all() for p in built.parameters())
