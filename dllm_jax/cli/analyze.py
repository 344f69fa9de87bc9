"""`dllm-jax analyze`: pattern diagnostics of a sparse method against dense attention for one prompt (PNG plots
and a summary)."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from dllm_jax.cli.common import add_quantize_flag, checked_out_dir, dtype_parent, write_files
from dllm_jax.cli.methods import methods_parent
from dllm_jax.cli.prompts import encode_prompt
from dllm_jax.cli.request import Request, checked_request
from dllm_jax.cli.sampling import sampling_parent
from dllm_jax.flags import non_negative_int


def bidirectional(request: Request) -> bool:
    """Whether the checkpoint's family decodes full-sequence steps (analyze: per-step patterns and per-head
    heat maps) rather than blocks over a KV cache (analyze_blocks)."""
    from dllm_jax.attention.methods import BIDIRECTIONAL
    from dllm_jax.families import family_named

    return family_named(request.family).method_kind == BIDIRECTIONAL


def add_parser(subparsers) -> None:
    analyze = subparsers.add_parser(
        "analyze", parents=[sampling_parent(), dtype_parent(), methods_parent()],
        help="pattern diagnostics of a sparse method for a prompt (PNG plots)",
        description="Generates with --method under a probe that also computes dense attention and writes to --out: "
                    "recall.png (kept pattern vs the per-step top-k oracle), error.png (relative L1 vs dense), for "
                    "LLaDA and Dream jaccard.png (oracle stability over steps) and head_patterns.png (per-head heat "
                    "maps), and summary.json. Builds [B, H, N, N] arrays: for short prompts.")
    analyze.add_argument("--out", default="analysis", help="output directory (default ./analysis)")
    analyze.add_argument("--layer", type=non_negative_int, default=None, metavar="N",
                         help="LLaDA, Dream: layer of the per-head heat maps (default the last)")
    add_quantize_flag(analyze)
    analyze.set_defaults(fn=run)


def run(args) -> None:
    """Generates under a pattern probe and writes the diagnostics plots and a summary."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("analyze draws its plots with matplotlib, which is not installed: pip install "
                         "'dllm-jax[analysis]'") from None

    matplotlib.use("Agg")  # files only: no display needed

    from dllm_jax.checkpoint import load_model

    request = checked_request(args)
    if request.method is None:
        raise ValueError("analyze compares a sparse --method with dense attention: pass one")
    layer = checked_layer(args.layer, request)
    out = checked_out_dir(Path(args.out))  # all checked before the run, which may take minutes
    tokenizer, ids = encode_prompt(args, request.config)
    model = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
    start = time.perf_counter()
    report, figures = probed_figures(model, ids, request, args.seed, layer)
    files = {name: png_bytes(fig) for name, fig in figures.items()}  # rendered before anything is written
    summary = dict(method=repr(request.method), prompt_tokens=int(ids.shape[1]), options=request.options,
                   **{k: None if v != v else v for k, v in report.summary().items()})  # NaN -> null (valid JSON)
    files["summary.json"] = (json.dumps(summary, indent=2) + "\n").encode()
    write_files(out, files)
    print(json.dumps(summary))
    print(f"wrote {', '.join(str(out / name) for name in files)} ({time.perf_counter() - start:.1f} s)",
          file=sys.stderr)


def probed_figures(model, ids, request: Request, seed: int, layer: int | None):
    """(the probe's report, {file name: matplotlib figure}) of one generate call under the pattern probe."""
    from dllm_jax.analysis import analyze, analyze_blocks, plot_error, plot_head_patterns, plot_jaccard, plot_recall

    if bidirectional(request):
        report = analyze(model, ids, request.method, seed=seed, **request.options)
        plots = {"recall": plot_recall, "jaccard": plot_jaccard, "error": plot_error}
    else:  # SDAR, LLaDA2: block diffusion over a prefix cache
        report = analyze_blocks(model, ids, request.method, seed=seed, **request.options)
        plots = {"recall": plot_recall, "error": plot_error}
    figures = {f"{name}.png": plot(report).figure for name, plot in plots.items()}
    if layer is not None:
        figures["head_patterns.png"] = plot_head_patterns(report, layer=layer)
    return report, figures


def checked_layer(layer: int | None, request: Request) -> int | None:
    """The layer of the per-head heat maps of LLaDA and Dream (default the last; None for SDAR and LLaDA2,
    which have no such plot)."""
    if not bidirectional(request):
        if layer is not None:
            raise ValueError(f"--layer applies to LLaDA models and Dream ones (the per-head heat maps); this "
                             f"checkpoint is {request.family}")
        return None
    count = request.config.num_layers
    if layer is None:
        return count - 1
    if not 0 <= layer < count:
        raise ValueError(f"--layer {layer} is not a layer of this model: it has {count} (0..{count - 1}, "
                         "from config.json)")
    return layer


def png_bytes(figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()
