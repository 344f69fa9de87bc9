"""Every size a throughput run uses (`Plan`): the 8B shapes on a device, `TINY` on a CPU, and what the
pre-issue-17 package runs (`baseline_plan`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every size a run uses: the 8B shapes on a device, tiny configs with `--tiny`."""

    sdar_model: str = "sdar-8b-chat"
    llada_model: str = "llada-8b-instruct"
    small_methods: bool = False  # scaled-down method parameters (tiny configs)
    copy_bytes: int = 2 << 30  # far beyond the L2 cache
    weight_tokens: tuple[int, ...] = (4, 32)
    sdar_prompts: tuple[int, ...] = (1024, 32768)
    sdar_batches: tuple[int, ...] = (1, 8, 32, 64)
    sdar_new_tokens: int = 128
    sdar_steps: int = 4
    methods: tuple[str, ...] = ("mage", "flashblock", "flashblock+mage")
    # batched methods at a short prompt, long-context methods at batch 1 (which the baseline also runs)
    method_points: tuple[tuple[int, tuple[int, ...]], ...] = ((1024, (8,)), (32768, (1,)))
    llada_prompt: int = 1024
    llada_block: int = 32
    llada_runs: tuple[tuple[int, int, int], ...] = ((1, 256, 256), (1, 256, 64), (8, 256, 64), (8, 64, 64))
    llada_caches: tuple[str | None, ...] = (None,)  # Fast-dLLM cache modes timed at every llada point
    llada_methods: tuple[str, ...] = ("dense",)  # LLaDA methods (defaults) timed at every llada point and cache
    long_prompt: int = 131072
    long_batches: tuple[int, ...] = (4, 1)
    # mage128k's methods, each against dense (always timed first): "mage/sort" and "mage/threshold" are MAGE with its
    # top k by lax.top_k over the scores and by the radix threshold instead of its default tile tournament;
    # "mage/keys" MAGE with its scores from the keys read again instead of its exact pass's logits, "mage/probs" from
    # their float16 form; "mage/per-layer" with each layer's top k found in the layer instead of in MAGE's one
    # batched selection after the block's first forward; "dense/apart": dense with the commit's segment attending in
    # a call of its own (the cache read twice in that forward); "dense/fp8": dense on a float8 cache
    long_methods: tuple[str, ...] = ("dense/apart", "dense/fp8", "mage", "mage/sort", "mage/threshold",
                                     "mage/per-layer", "mage/keys", "mage/probs", "flashblock", "flashblock+mage")
    execution: str | None = None  # the models' layer execution (`load_model`'s); None: the package default
    quantize: str | None = None  # the models' weight quantization (`load_model`'s): None, "int8" or "fp8"


TINY = Plan(sdar_model="tiny-sdar", llada_model="tiny-llada", small_methods=True, copy_bytes=16 << 20,
            weight_tokens=(4, 32), sdar_prompts=(16,), sdar_batches=(1, 2), sdar_new_tokens=8,
            methods=("mage",), method_points=((16, (1,)),), llada_prompt=16, llada_block=8,
            llada_runs=((1, 16, 16), (2, 16, 4)), llada_caches=(None, "prefix", "dual"), llada_methods=("dense", "sparsed"),
            long_prompt=128, long_batches=(2, 1))


def baseline_plan(plan: Plan) -> Plan:
    """What the pre-issue package runs: SDAR at batch 1 only (generate, the methods where the plan
    runs them at batch 1, MAGE against the long cache)."""
    return dataclasses.replace(plan, sdar_batches=(1,), long_batches=(1,),
                               method_points=tuple((p, (1,)) for p, batches in plan.method_points if 1 in batches))
