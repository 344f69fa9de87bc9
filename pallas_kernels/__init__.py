"""Pallas GPU attention kernels (and two matmuls: the grouped one of mixture-of-experts layers, and decode's
GEMM of int8 / FP8 weights; and MAGE's top-k selection without a sort), one per module, each with a pure-JAX
`<name>_reference` of the same signature computing the same function densely. Triton-lowered kernels run on any CUDA GPU
(and in interpret mode on CPU); on Hopper (sm90+) `flash_attention`, `block_sparse_attention` and
`flash_block_mass` run a warp-specialised Mosaic GPU kernel (`pallas_kernels.mosaic`; their
`backend` argument picks: "auto", "mosaic" or "triton"; the dllm_jax policies resolve their own
`backend` in `dllm_jax.attention.backends` and pass "mosaic" or "triton" here, never "auto").

Layouts: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] (GQA: Hq % Hkv == 0); every LSE is the natural-log
log-sum-exp of the scaled logits, float32 [B, Hq, Nq], -inf for rows that saw no key.
"""

from pallas_kernels._common import check_scale
from pallas_kernels.block_mass import (
    flash_block_mass,
    flash_block_mass_reference,
    pooled_block_scores,
    suffix_lse,
)
from pallas_kernels.block_scores import block_scores, block_scores_reference
from pallas_kernels.block_sparse import block_sparse_attention, block_sparse_attention_reference
from pallas_kernels.column_scores import column_scores, column_scores_reference
from pallas_kernels.column_sparse import column_sparse_attention, column_sparse_attention_reference
from pallas_kernels.flash import flash_attention, flash_attention_reference
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.kv_scores import (kv_scores, kv_scores_from_logits, kv_scores_from_logits_reference,
                                      kv_scores_from_probs, kv_scores_from_probs_reference, kv_scores_reference)
from pallas_kernels.merge import merge_attention, merge_attention_reference
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference
from pallas_kernels.sparge import (
    SpargeSparsity,
    predict_block_map,
    pv_skip_attention,
    pv_skip_attention_reference,
    sparge_attention,
    sparge_attention_reference,
)
from pallas_kernels.split_kv import (
    split_kv_attention,
    split_kv_attention_reference,
    split_kv_combine,
    split_kv_combine_reference,
    split_kv_gather_attention,
    split_kv_gather_attention_reference,
    split_kv_gather_width,
)
from pallas_kernels.top_k import top_k_positions, top_k_positions_reference

__all__ = [
    "check_scale",
    "block_scores", "block_scores_reference",
    "flash_block_mass", "flash_block_mass_reference", "pooled_block_scores", "suffix_lse",
    "block_sparse_attention", "block_sparse_attention_reference",
    "column_scores", "column_scores_reference",
    "column_sparse_attention", "column_sparse_attention_reference",
    "flash_attention", "flash_attention_reference",
    "grouped_matmul", "grouped_matmul_reference",
    "kv_scores", "kv_scores_from_logits", "kv_scores_from_logits_reference", "kv_scores_from_probs",
    "kv_scores_from_probs_reference", "kv_scores_reference",
    "merge_attention", "merge_attention_reference",
    "quantized_matmul", "quantized_matmul_reference",
    "SpargeSparsity", "predict_block_map",
    "pv_skip_attention", "pv_skip_attention_reference",
    "sparge_attention", "sparge_attention_reference",
    "split_kv_attention", "split_kv_attention_reference", "split_kv_combine", "split_kv_combine_reference",
    "split_kv_gather_attention", "split_kv_gather_attention_reference", "split_kv_gather_width",
    "top_k_positions", "top_k_positions_reference",
]
