"""The models `dllm-jax bench` and benchmarks/*.py time: random weights at a shipped or tiny config, and the
attention methods timed per family."""

from __future__ import annotations

import dataclasses

import jax


def family_methods(family: str, small: bool) -> dict:
    """The methods timed per family: the defaults at real sizes, scaled-down blocks for tiny ones."""
    from dllm_jax.attention.methods import BIDIRECTIONAL, make_method
    from dllm_jax.families import family_named

    if family_named(family).method_kind == BIDIRECTIONAL:  # LLaDA, Dream: the same methods
        params = dict(sparsed=dict(block_size=16), pulsecol=dict(group_size=16), sparge=dict(block_q=16, block_kv=16))
        names = ["sparsed", "pulsecol", "sparge"]
    else:
        params = {"mage": dict(k=16, exact_layers=1), "flashblock+mage": dict(k=16, exact_layers=1)}
        names = ["mage", "flashblock", "flashblock+mage"]
    return {"dense": None} | {name: make_method(name, **(params.get(name, {}) if small else {})) for name in names}


def model_for(name: str, *, layers: int | None, context: int, dtype, execution: str | None = None, mesh=None,
              quantize: str | None = None):
    """(model, config) with random weights: a shipped config name, or "tiny-llada" / "tiny-sdar" / "tiny-dream" /
    "tiny-llada2"; `execution`, `mesh` and `quantize` as `load_model` takes them (None: its default, one device,
    unquantized)."""
    from dllm_jax.checkpoint.api import model_from_params, quantize_params
    from dllm_jax.config import shipped_config
    from dllm_jax.families import family_of
    from dllm_jax.testing import (random_params, tiny_dream_config, tiny_llada2_config, tiny_llada_config,
                                  tiny_sdar_config)

    tiny = {"tiny-llada": tiny_llada_config, "tiny-sdar": tiny_sdar_config, "tiny-dream": tiny_dream_config,
            "tiny-llada2": tiny_llada2_config}
    config = tiny.get(name, lambda: shipped_config(name))()
    changes = dict(max_position_embeddings=max(config.max_position_embeddings, context))  # random weights: no limit
    if layers is not None:
        changes["num_layers"] = layers
    # no stop token where the family allows none: random weights would stop at a random EOS
    config = family_of(config).without_stops(dataclasses.replace(config, **changes))
    layout = {} if execution is None else dict(execution=execution)
    params, config = quantize_params(random_params(config, jax.random.key(0), dtype), config, quantize)
    return model_from_params(config, params, mesh=mesh, **layout), config
