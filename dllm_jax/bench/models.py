"""The models `dllm-jax bench` and benchmarks/*.py time: random weights at a shipped or tiny config, and the
attention methods timed per family."""

from __future__ import annotations

import dataclasses

import jax


def timed_method_names(family: str) -> list[str]:
    """The methods `dllm-jax bench` times for a family (its label): "dense" and every method that applies to it (the
    registry's `Family.methods`)."""
    from dllm_jax.families import family_named

    return ["dense", *family_named(family).methods]


def family_methods(family: str, small: bool, names=None) -> dict:
    """{name: policy} of the methods timed for a family (the family's label): "dense" (None) and every method that
    applies to it (the registry's `Family.methods`), or those of `names` that apply; the methods' defaults at real
    sizes, scaled-down blocks for tiny ones."""
    from dllm_jax.attention.methods import make_method

    small_params = dict(sparsed=dict(block_size=16), pulsecol=dict(group_size=16), sparge=dict(block_q=16, block_kv=16),
                        mage=dict(k=16, exact_layers=1), **{"flashblock+mage": dict(k=16, exact_layers=1)})
    applies = timed_method_names(family)
    chosen = applies if names is None else [name for name in applies if name in names]
    return {name: None if name == "dense" else make_method(name, **(small_params.get(name, {}) if small else {}))
            for name in chosen}


def model_config(name: str):
    """The config of a shipped config name, or of "tiny-llada" / "tiny-sdar" / "tiny-dream" / "tiny-llada2"."""
    from dllm_jax.config import shipped_config
    from dllm_jax.testing import tiny_dream_config, tiny_llada2_config, tiny_llada_config, tiny_sdar_config

    tiny = {"tiny-llada": tiny_llada_config, "tiny-sdar": tiny_sdar_config, "tiny-dream": tiny_dream_config,
            "tiny-llada2": tiny_llada2_config}
    return tiny[name]() if name in tiny else shipped_config(name)


def model_family(name: str) -> str:
    """The family label of `model_config(name)`."""
    from dllm_jax.families import family_of

    return family_of(model_config(name)).label


def model_for(name: str, *, layers: int | None, context: int, dtype, execution: str | None = None, mesh=None,
              quantize: str | None = None):
    """(model, config) with random weights: a shipped config name, or "tiny-llada" / "tiny-sdar" / "tiny-dream" /
    "tiny-llada2"; `execution`, `mesh` and `quantize` as `load_model` takes them (None: its default, one device,
    unquantized)."""
    from dllm_jax.checkpoint.api import model_from_params, quantize_params
    from dllm_jax.families import family_of
    from dllm_jax.testing import random_params

    config = model_config(name)
    changes = dict(max_position_embeddings=max(config.max_position_embeddings, context))  # random weights: no limit
    if layers is not None:
        changes["num_layers"] = layers
    # no stop token where the family allows none: random weights would stop at a random EOS
    config = family_of(config).without_stops(dataclasses.replace(config, **changes))
    layout = {} if execution is None else dict(execution=execution)
    params, config = quantize_params(random_params(config, jax.random.key(0), dtype), config, quantize)
    return model_from_params(config, params, mesh=mesh, **layout), config
