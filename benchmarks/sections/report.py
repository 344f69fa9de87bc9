"""The Markdown of a throughput run (a header, then each section's table in section order) and the short
summary printed last; the registry of sections by name."""

from __future__ import annotations

from . import bandwidth, compile_time, llada, long_cache, sdar, weights

MODULES = {m.SECTION: m for m in (bandwidth, weights, sdar, llada, long_cache, compile_time)}  # in run order
SECTIONS = tuple(MODULES)
# section: (the fields naming a point, the value compared, its unit, whether larger is better)
COMPARED = {name: m.COMPARED for name, m in MODULES.items() if hasattr(m, "COMPARED")}


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Throughput — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"Random bf16 weights at the real shapes; package `{meta['package']}`"
             + (" (baseline mode: what the pre-issue API runs)" if meta.get("baseline") else "") + ".", ""]
    if meta.get("xla_flags"):  # e.g. XLA's command buffers (CUDA graphs): every row of the run ran under them
        lines[-1:-1] = [f"Run with `XLA_FLAGS={meta['xla_flags']}`.", ""]
    quantize = meta.get("plan", {}).get("quantize")
    if quantize:
        lines[-1:-1] = [f"**Linear weights quantized to {quantize}** (`load_model(quantize={quantize!r})`: a scale "
                        "per output channel, the LM head included; embedding and norms in bf16).", ""]
    for name, module in MODULES.items():
        mine = [r for r in rows if r.get("section") == name]
        if mine:
            lines += module.table(meta, mine)
    notes = [r["text"] for r in rows if r.get("section") == "note"]
    return lines + (["", "Notes: " + "; ".join(notes) + "."] if notes else [])


def summary(rows: list[dict]) -> list[str]:
    """The short table printed last: one headline per measured row."""
    return ["| result | value |", "|---|---|"] + [MODULES[r["section"]].headline(r) for r in rows
                                                  if r.get("section") in MODULES and "skipped" not in r
                                                  and "error" not in r]
