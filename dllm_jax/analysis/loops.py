"""The generate loop the probes run in: the model's family's `probe_loop` (dllm_jax.families), which
checks the request exactly as `dllm_jax.generate.generate` does and returns a `ProbeLoop`: the method
as generate runs it, the number of policy calls per layer the probe must make room for, and the
family's compiled loop with `return_policy_state=True` under a given probe policy. `analyze` probes
the bidirectional families (method kind BIDIRECTIONAL), `analyze_blocks` the block-diffusion ones."""

from __future__ import annotations

from dllm_jax.attention.methods import BIDIRECTIONAL, BLOCK
from dllm_jax.families import family_for_kind, family_of_model
from dllm_jax.generate.requests import ProbeLoop


ANALYSES = {BIDIRECTIONAL: "analyze", BLOCK: "analyze_blocks"}  # method kind -> the function that probes it


def loop_for(kind: str, model, prompt_ids, method, options: dict) -> ProbeLoop:
    """The probe loop of `model`'s family, which must be of method kind `kind`; ValueError for a model of
    another kind (naming the function that takes it) or of no family, and for a method of the other kind."""
    caller = ANALYSES[kind]
    family = family_of_model(model)
    if family is None or family.method_kind != kind:
        names = " and ".join(f.label for f in family_for_kind(kind))
        hint = ""
        if family is not None and family.method_kind in ANALYSES:
            other = family_for_kind(family.method_kind)
            hint = f" ({' and '.join(f.label for f in other)} models: {ANALYSES[family.method_kind]})"
        elif family is not None:
            hint = f" ({family.label}: its loop has no pattern probes)"
        raise ValueError(f"{caller} takes {names} models, got {type(model).__name__}{hint}")
    family.check_method(method)
    return family.probe_loop(model, prompt_ids, method, options)
