"""MAGE ([MASK]-guided sparse attention, arXiv 2602.14209 v2; no public code, papers/mage.md and
docs/methods.md §3) as an attention policy for SDAR block diffusion.

Step 1 of each block (its tokens are all [MASK]) attends exactly over the cache prefix plus the
block, as two parts merged by LSE (the N prefix keys, then the block's own keys), and, per layer
and KV head, keeps the top-k prefix positions by the paper's Eq. 3 (`select_prefix`):

    score_i = 1/(G B) sum_{g in group(h)} sum_{q in block} softmax_i(Q K_prefix^T / sqrt(d))[g, q],

the softmax taken over the N prefix keys only (A in R^{G x B x N}). The prefix part's LSE is what
that softmax needs, so the selection costs no extra attention pass. `softmax_over="prefix+block"`
takes the softmax over prefix + block keys instead (i.e. each query weighted by its attention mass
on the prefix); the two rankings differ when queries split their mass
unevenly between prefix and block.
Steps 2..T of the block attend to those k prefix entries plus the whole current block in one gathered
split-KV pass (the block's rows listed after the selection: a `Selection` made once at step 1 and kept in
the state, so a later step launches the gathered kernel alone). Layers below `exact_layers` stay exact; a
prefix of at most k positions is kept whole, so attention is then exact too. Every row's first forward of
a block estimates (`first_steps_estimate`): no per-layer conditional on the mode there.

Batched rows may sit at different positions: `kv_len` is per row (int32 [B]; a scalar applies to
every row) and so are the prefix lengths, the block's rows in the cache and the counts. `mode` may be
per row too (int32 [B], `policy.switch_rows`): each branch runs only if some row needs it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from dllm_jax import validation
from dllm_jax.attention import kernels
from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.policy import AttentionPolicy, Mode, check_backend, check_field, field_label, switch_rows
from dllm_jax.attention.select import check_method, top_k_positions


SOFTMAX_OVER = ("prefix", "prefix+block")  # Eq. 3 (the default); the softmax over prefix + block keys
# where Eq. 3's probabilities come from: the logits the step's exact prefix pass wrote (default), their float16 form
# relative to each key tile's maximum (half the bytes), or the keys read again
SCORES_FROM = ("logits", "probs", "keys")


def check_softmax_over(softmax_over: str, name: str = "softmax_over") -> None:
    if not isinstance(softmax_over, str) or softmax_over not in SOFTMAX_OVER:
        raise ValueError(f"{name}={softmax_over!r} is not one of {SOFTMAX_OVER}")


def row_lengths(lengths, batch: int):
    """int32 [B] of an int scalar (every row) or int [B] (one per row): prefix and cache lengths."""
    return jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (batch,))


def select_prefix(q_block, k_cache, *, prefix_len, k: int, scale=None, backend: str = "auto", lse=None,
                  softmax_over: str = "prefix", select_by: str = "tiles", logits=None, probs=None):
    """MAGE's selection: int32 [B, Hkv, k], ascending.

    q_block [B, n, Hq, D]; k_cache [B, S, Hkv, D] (one layer) holding row b's committed prefix in
    [0, prefix_len[b]) and the block's own keys in [prefix_len[b], prefix_len[b] + n), as SDAR's
    cache does during a block step; prefix_len: int scalar (every row) or int32 [B]. Each prefix
    position is scored by its softmax probability averaged over the G query heads of its KV head and
    the n queries; the softmax runs over the prefix_len prefix keys (the paper's Eq. 3,
    softmax_over="prefix") or over all prefix_len + n keys ("prefix+block"); only prefix positions
    are ranked. With fewer than k prefix positions all of them are returned, padded by repeating the
    last (the valid count is `min(k, prefix_len)`, see `prefix_counts`). `lse` f32 [B, Hq, n]: the
    LSE of the queries over the keys the softmax runs over, if the caller already has it (MAGE's
    first step does: its prefix part). `select_by`: how the top k are found, "sort", "tiles" or "threshold"
    (`dllm_jax.attention.select`: the same positions). `logits`: the scaled prefix logits f32 [B, Hkv, G * n, S]
    of a split-KV pass over at least the prefix (`kernels.split_kv(..., return_logits=True)`) with `lse`: the
    scores are then made from them (`kernels.kv_scores_from_logits`) instead of reading the keys again. `probs`:
    instead, the pass's float16 form (probs, tile_max) (`kernels.split_kv(..., return_probs=True)`), with `lse`.
    """
    ranked = prefix_scores(q_block, k_cache, prefix_len=prefix_len, scale=scale, backend=backend, lse=lse,
                           softmax_over=softmax_over, logits=logits, probs=probs)
    return ranked_selection(ranked, row_lengths(prefix_len, q_block.shape[0]), k=k, select_by=select_by)


def prefix_scores(q_block, k_cache, *, prefix_len, scale=None, backend: str = "auto", lse=None,
                  softmax_over: str = "prefix", logits=None, probs=None):
    """The scores `select_prefix` ranks, f32 [B, Hkv, S]: Eq. 3's at the prefix positions, -inf elsewhere (its
    arguments but k and select_by)."""
    check_softmax_over(softmax_over)
    b, n = q_block.shape[:2]
    prefix_len = row_lengths(prefix_len, b)
    kv_len = prefix_len + (n if softmax_over == "prefix+block" else 0)
    if (logits is not None or probs is not None) and lse is None:
        raise ValueError("select_prefix takes logits together with the LSE they were normalised by")
    # from a pass's logits: columns past the prefix score 0 there and are not ranked below, whichever softmax_over
    if logits is not None:
        scores = kernels.kv_scores_from_logits(logits, lse, prefix_len, backend)
    elif probs is not None:
        scores = kernels.kv_scores_from_probs(*probs, lse, prefix_len, backend)
    else:
        if lse is None:  # only the LSE is used
            _, lse = kernels.split_kv(q_block, k_cache, k_cache, kv_len, backend, scale)
        scores = kernels.kv_scores(q_block, k_cache, lse, kv_len, backend, scale)
    return jnp.where(jnp.arange(scores.shape[-1]) < prefix_len[:, None, None], scores, -jnp.inf)


def ranked_selection(ranked_scores, prefix_len, *, k: int, select_by: str = "tiles"):
    """`select_prefix`'s selection int32 [B, Hkv, k] from its ranked scores f32 [B, Hkv, S] (-inf off the prefix)
    and the prefix lengths int32 [B]."""
    if k > ranked_scores.shape[-1]:  # k beyond the cache capacity: every prefix position is kept
        ranked_scores = jnp.pad(ranked_scores, ((0, 0), (0, 0), (0, k - ranked_scores.shape[-1])),
                                constant_values=-jnp.inf)
    # ascending; with fewer than k prefix positions, all of them come first (every other score is -inf
    # and its ties go to the lower positions, those of the block and the free rows after the prefix)
    ordered = top_k_positions(ranked_scores, k, method=select_by)
    count = prefix_counts(prefix_len, k)[:, None, None]
    # the first `count` picks are the prefix positions; repeat the last one after them
    last = jnp.take_along_axis(ordered, jnp.maximum(count - 1, 0) * jnp.ones_like(ordered[..., :1]), axis=-1)
    return jnp.where(jnp.arange(k) < count, ordered, jnp.where(count > 0, last, 0)).astype(jnp.int32)


def prefix_counts(prefix_len, k: int):
    """The valid entries of a selection of k from prefix_len positions (elementwise: scalar or [B])."""
    return jnp.minimum(jnp.asarray(prefix_len, jnp.int32), k)


def block_attention(q, k, v, kv_len, backend: str):
    """(o, lse) of a block step's queries q [B, n, Hq, D] over the block's own keys, rows [kv_len - n, kv_len) of one
    layer's cache k, v [B, S, Hkv, D] (kv_len: int scalar or int32 [B]), read in place by the gathered split-KV
    pass (slicing the rows out for the flash kernel cost two slices and the kernel's padding per layer and step:
    ~100 pad launches per output block at 128k, batch 1)."""
    nothing_selected = jnp.zeros((q.shape[0], k.shape[2], 0), jnp.int32)  # the block's rows alone: MAGE's list
    listed, counts = with_block_rows(nothing_selected, kv_len, q.shape[1])
    return kernels.split_kv_gather(q, k, v, listed, counts, backend)


def with_block_rows(indices, kv_len, n: int):
    """(indices [B, Hkv, W], counts [B, Hkv]): each row's selection of its prefix `indices` [B, Hkv, k]
    (`select_prefix`'s layout) with the current block's n cache rows [kv_len - n, kv_len) listed right after
    its valid entries, so one gathered pass attends to both, W = k + n rounded up to the gathered kernel's whole
    key tiles (`pk.split_kv_gather_width`: read as it is). Entries past the count repeat the block's last row (in
    range, masked by the kernel)."""
    b, hkv, k = indices.shape
    width = pk.split_kv_gather_width(k + n)
    kv_len = row_lengths(kv_len, b)[:, None, None]
    count = prefix_counts(kv_len - n, k)
    slot = jnp.arange(width)
    block_row = jnp.minimum(kv_len - n + (slot - count), kv_len - 1)
    padded = jnp.pad(indices, ((0, 0), (0, 0), (0, width - k)))
    listed = jnp.where(slot < count, padded, block_row).astype(jnp.int32)
    return listed, jnp.broadcast_to(count[..., 0] + n, (b, hkv))


@struct.dataclass
class Selection:
    """One layer's selection, every leaf batch-first. indices int32 [B, Hkv, k]: the prefix positions
    (`select_prefix`'s layout); listed int32 [B, Hkv, W] and counts int32 [B, Hkv]: the same positions with the
    block's n cache rows after them, padded to the gathered kernel's whole key tiles (`with_block_rows`). Made
    once, at a block's first step: its later steps and its commit attend through the list as it is, one kernel
    per layer (the list rebuilt and padded per step cost three more)."""

    indices: jax.Array
    listed: jax.Array
    counts: jax.Array


def selection_of(indices, kv_len, n: int) -> Selection:
    """The `Selection` of prefix positions `indices` [B, Hkv, k] for a block of n queries whose cache holds
    kv_len rows (int scalar or int32 [B]: the block's rows end there)."""
    listed, counts = with_block_rows(indices, kv_len, n)
    return Selection(indices=indices, listed=listed, counts=counts)


@struct.dataclass
class Pending:
    """What a deferring MAGE's block-first forward (`MAGE.deferring`) keeps of one layer for `MAGE.settle`, every
    leaf batch-first: the ranked scores f32 [B, Hkv, S] (`prefix_scores`) and the cache lengths int32 [B] they were
    scored at; `block`: the block's query count."""

    scores: jax.Array
    kv_len: jax.Array
    block: int = struct.field(pytree_node=False)


def selected_attention(q, k, v, selection: Selection, backend: str):
    """(o, lse) over the selected prefix rows plus the whole current block, in one gathered split-KV pass (a
    separate block pass merged by LSE cost six small kernels per layer and step)."""
    return kernels.split_kv_gather(q, k, v, selection.listed, selection.counts, backend)


def gather_rows(buffer, indices):
    """[B, k, Hkv, D]: the rows `indices` [B, Hkv, k] (`select_prefix`'s layout) of one layer's cache buffer
    [B, S, Hkv, D], each KV head its own: out[b, j, h] = buffer[b, indices[b, h, j], h]."""
    return jnp.take_along_axis(buffer, jnp.swapaxes(indices, 1, 2)[..., None], axis=1)


def canvas_prefix_scores(q, k_cache, prefix_len, *, scale, softmax_over: str = "prefix"):
    """`prefix_scores` in plain jnp for query blocks no kernel here takes (a DiffusionGemma canvas: 256 queries
    times the group, 512-wide heads): f32 [B, Hkv, S], Eq. 3's score at each of a row's prefix positions (its
    softmax over the prefix, or with softmax_over="prefix+block" over the prefix and the n rows after it, the
    block's own), -inf elsewhere. q [B, n, Hq, D]; k_cache [B, S, Hkv, D]; prefix_len int scalar or int32 [B]."""
    check_softmax_over(softmax_over)
    b, n, hq, _ = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    prefix_len = row_lengths(prefix_len, b)[:, None, None, None]
    seen = prefix_len + (n if softmax_over == "prefix+block" else 0)
    grouped = q.reshape(b, n, hkv, hq // hkv, -1).astype(jnp.float32)
    logits = jnp.einsum("bnhgd,bshd->bhgns", grouped, k_cache.astype(jnp.float32)) * scale
    position = jnp.arange(s)
    probs = jax.nn.softmax(jnp.where(position < seen[..., None], logits, -jnp.inf), axis=-1)
    return jnp.where(position < prefix_len[..., 0], jnp.mean(probs, axis=(2, 3)), -jnp.inf)


def canvas_attention(q, k, v, k_cache, v_cache, indices, prefix_len, *, scale, backend: str = "auto"):
    """A later step's attention for decoders whose heads no kernel here takes (DiffusionGemma's canvas, 512 wide):
    queries q [B, n, Hq, D] over the selected prefix rows `indices` [B, Hkv, k] of one layer's cache k_cache,
    v_cache [B, S, Hkv, D] (the first min(k, prefix_len[b]) of a row valid, `prefix_counts`) and over the n new
    tokens' own keys and values k, v [B, n, Hkv, D]: one `dense_attention` over the gathered rows followed by
    the new ones. prefix_len: int scalar or int32 [B]; `backend`: dense_attention's."""
    b, n = q.shape[:2]
    valid = jnp.arange(indices.shape[-1]) < prefix_counts(row_lengths(prefix_len, b), indices.shape[-1])[:, None]
    keys = jnp.concatenate([gather_rows(k_cache, indices), k.astype(k_cache.dtype)], axis=1)
    values = jnp.concatenate([gather_rows(v_cache, indices), v.astype(v_cache.dtype)], axis=1)
    key_mask = jnp.concatenate([valid, jnp.ones((b, n), bool)], axis=1)
    return dense_attention(q, keys, values, key_mask=key_mask, scale=scale, backend=backend)


def split_exact_attention(q, k, v, kv_len, backend: str, *, return_logits: bool = False, return_probs: bool = False):
    """Exact attention of a block step as its prefix part and its block part merged by LSE:
    (o, lse over prefix + block, prefix_lse over the prefix alone, what Eq. 3's softmax needs), and with
    return_logits the prefix pass's logits, with return_probs their float16 form (probs, tile_max)
    (`kernels.split_kv`'s; columns past the prefix unspecified)."""
    n = q.shape[1]
    o_prefix, prefix_lse, *stored = kernels.split_kv(q, k, v, row_lengths(kv_len, q.shape[0]) - n, backend,
                                                     return_logits=return_logits, return_probs=return_probs)
    o, lse = pk.merge_attention(o_prefix, prefix_lse, *block_attention(q, k, v, kv_len, backend))
    return (o, lse, prefix_lse, *stored)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MAGE(AttentionPolicy):
    """MAGE's configuration.

    k: prefix positions kept per (layer, KV head) (256, 512 or 1024 in the paper; 512 by default).
    exact_layers: the first layers that always attend exactly (2).
    softmax_over: "prefix" (the paper's Eq. 3: the selection's softmax over the prefix keys alone)
      or "prefix+block" (the softmax over the prefix and the block's keys together).
    backend: as SparseD's ("auto": Pallas on GPU, references elsewhere).
    select_by: how each layer's top k are found: "tiles" (default: `lax.top_k` over tile maxima, then over the k
      best tiles' entries), "sort" (`lax.top_k` over the scores, by chunks on a GPU) or "threshold" (a radix
      search for the k-th score, no sort); the same positions (`dllm_jax.attention.select`). "tiles" is the
      default because it is the fastest: at 128k keys, batch 4 on an H200, about a third of "sort"'s time per
      layer (docs/benchmarks.md).
    scores_from: where Eq. 3's probabilities come from: "logits" (default: the logits the first step's exact
      prefix pass writes, 4 G n bytes per key), "probs" (their float16 form relative to each key tile's maximum,
      2 G n bytes per key: each probability to float16's rounding, 2**-11 relative, where it is at least 2**-14
      of its tile's largest) or "keys" (`kv_scores`: the keys read again, 2 D bytes per key). "logits" and "keys"
      give the same scores up to float32 rounding.
    select_after_forward: find every sparse layer's top k after a block's first forward, in one batched selection
      over all of them (default), instead of in each layer (False): the same positions, a few launches per block
      instead of a few per layer, which gains most at batch 1, where the fixed cost of each launch weighs most
      (docs/benchmarks.md). It applies where the loop carries one state per layer (SDAR's block loop with
      unrolled layers) and every row estimates at that forward; elsewhere each layer selects its own.
    """

    k: int = 512
    exact_layers: int = 2
    softmax_over: str = "prefix"
    backend: str = "auto"
    select_by: str = "tiles"
    scores_from: str = "logits"
    select_after_forward: bool = True
    # set by `deferring`: a block-first forward that estimates every row stores each layer's scores (`Pending`) for
    # `settle` to select from, all layers at once
    defers: bool = dataclasses.field(default=False, repr=False)
    # set by `at_layer` where the layer index is static: whether this layer attends exactly (None: the
    # state's per-layer flag decides, as in a scan over layers)
    layer_is_exact: bool | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        # int32 bounds: k sizes the int32 selection and exact_layers meets an int32 layer index
        check_field(self, "k", validation.integer, maximum=validation.INT32_MAX)
        check_field(self, "exact_layers", validation.integer, minimum=0, maximum=validation.INT32_MAX)
        check_softmax_over(self.softmax_over, field_label(self, "softmax_over"))
        check_backend(self)
        check_method(self.select_by, field_label(self, "select_by"))
        check_field(self, "scores_from", validation.choice, choices=SCORES_FROM)
        check_field(self, "select_after_forward", validation.flag)
        if not (self.layer_is_exact is None or isinstance(self.layer_is_exact, bool)):
            raise ValueError(f"{field_label(self, 'layer_is_exact')} must be None or a bool, "
                             f"got {self.layer_is_exact!r}")

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        """(Selection, exact): nothing selected yet (a sparse step before any first step attends to no key)."""
        width = pk.split_kv_gather_width(self.k + q_len)
        empty = Selection(indices=jnp.zeros((batch, num_kv_heads, self.k), jnp.int32),
                          listed=jnp.zeros((batch, num_kv_heads, width), jnp.int32),
                          counts=jnp.zeros((batch, num_kv_heads), jnp.int32))
        return empty, jnp.zeros((), bool)

    def stack_layers(self, states):
        selection, exact = states
        return selection, jnp.arange(exact.shape[0]) < self.exact_layers

    def state_partition(self):
        # (the selection per KV head, exact layer)
        return Selection(indices=P("dp", "tp", None), listed=P("dp", "tp", None), counts=P("dp", "tp")), P()

    def mode(self, step):
        return jnp.where(step == 0, int(Mode.ESTIMATE), int(Mode.SPARSE))  # step: within the block

    def at_layer(self, layer: int) -> "MAGE":
        return dataclasses.replace(self, layer_is_exact=layer < self.exact_layers)

    def block_mode(self, step, *, unmasked, commit):
        # a commit reuses the selection as the block's later steps do (every committed block was denoised)
        return jnp.where(commit, int(Mode.SPARSE), self.mode(step))

    def later_steps_sparse(self) -> bool:
        return True  # `mode`: every step after a block's first reuses its selection

    def first_steps_estimate(self) -> bool:
        # a waiting row re-selects for its own cache instead of keeping a list made for another block (which would
        # name that block's rows); its output is not used. No per-layer conditional at a block's first forward
        return True

    def commits_sparse(self) -> bool:
        return True  # `block_mode(..., commit=True)`

    def deferring(self) -> "MAGE | None":
        return dataclasses.replace(self, defers=True) if self.select_after_forward else None

    def settle(self, layers: tuple) -> tuple:
        """Every layer's `Selection` from the `Pending` scores a deferring forward left (one state per layer in and
        out; a layer without any, exact or not deferred, as it is): one top k over all of them."""
        waiting = [i for i, state in enumerate(layers) if isinstance(state[-1], Pending)]
        if not waiting:
            return layers
        first = layers[waiting[0]][2]  # every layer of one forward scored at the same lengths
        prefix_len = first.kv_len - first.block
        scores = jnp.stack([layers[i][2].scores for i in waiting])
        indices = jax.vmap(lambda s: ranked_selection(s, prefix_len, k=self.k, select_by=self.select_by))(scores)
        settled = list(layers)
        for j, i in enumerate(waiting):
            settled[i] = (selection_of(indices[j], first.kv_len, first.block), layers[i][1])
        return tuple(settled)

    def attend(self, q, k, v, state, mode, *, kv_len=None, **masks):
        """k, v: one layer's cache [B, S, Hkv, D]; kv_len: int scalar or int32 [B]; mode: int32 scalar
        or [B] (per row: each branch runs only if some row needs it, see `switch_rows`)."""
        kernels.check_masks("MAGE", masks)
        if kv_len is None:
            raise ValueError("MAGE attends a query block against a KV cache: it needs kv_len (SDAR block steps)")
        selection, exact = state
        kv_len = row_lengths(kv_len, q.shape[0])

        def exact_step(_):
            return kernels.split_kv(q, k, v, kv_len, self.backend)[0], selection

        def estimate(_):
            out, selected = self.estimate(q, k, v, kv_len, defer=defer)
            return out.astype(q.dtype), selected

        def sparse(_):  # leaves the selection unchanged (rows waiting for the others' blocks get SPARSE)
            out, _ = selected_attention(q, k, v, selection, self.backend)
            return out.astype(q.dtype), selection

        # DENSE (and REFRESH, which has nothing to refresh here) attend exactly
        if self.layer_is_exact is not None:
            exact = self.layer_is_exact
        if exact is True:  # an exact layer known while tracing: whatever the mode
            index = 0
        elif exact is False and isinstance(mode, int):  # both known while tracing: one branch, no switch
            index = {int(Mode.ESTIMATE): 1, int(Mode.SPARSE): 2}.get(mode, 0)
        else:
            mode = jnp.asarray(mode)
            branch = jnp.where(mode == int(Mode.ESTIMATE), 1, jnp.where(mode == int(Mode.SPARSE), 2, 0))
            index = jnp.where(exact, 0, branch)
        defer = self.defers and isinstance(index, int) and index == 1  # a static ESTIMATE: its one branch alone
        out, selected = switch_rows(index, [exact_step, estimate, sparse], None)
        if defer:  # the selection waits for `settle`
            return out, (selection, state[1], selected)
        return out, (selected, state[1])

    def estimate(self, q, k, v, kv_len, *, defer: bool = False):
        """A block's first step in a sparse layer: (exact out [B, n, Hq, D] f32, its `Selection`; with `defer`, the
        `Pending` scores instead)."""
        out, lse, prefix_lse, *stored = split_exact_attention(q, k, v, kv_len, self.backend,
                                                               return_logits=self.scores_from == "logits",
                                                               return_probs=self.scores_from == "probs")
        n = q.shape[1]
        scores = self.scores(q, k, kv_len, lse, prefix_lse=prefix_lse,
                             logits=stored[0] if self.scores_from == "logits" else None,
                             probs=stored if self.scores_from == "probs" else None)
        if defer:
            return out, Pending(scores=scores, kv_len=kv_len, block=n)
        indices = ranked_selection(scores, kv_len - n, k=self.k, select_by=self.select_by)
        return out, selection_of(indices, kv_len, n)

    def select(self, q, k, kv_len, lse=None, *, prefix_lse=None, logits=None, probs=None):
        """`select_prefix` for a block step against one layer's whole cache buffer k (kv_len: int or int32 [B]). `lse`
        (over prefix + block) and `prefix_lse` (over the prefix alone; see `split_exact_attention`) are what
        the caller already has; the one `softmax_over` needs is used, and computed here when not given.
        `logits` or `probs`: the prefix pass's (`split_exact_attention(..., return_logits=True)` or
        `return_probs=True`), used with that LSE."""
        kv_len = row_lengths(kv_len, q.shape[0])
        return ranked_selection(self.scores(q, k, kv_len, lse, prefix_lse=prefix_lse, logits=logits, probs=probs),
                                kv_len - q.shape[1], k=self.k, select_by=self.select_by)

    def scores(self, q, k, kv_len, lse=None, *, prefix_lse=None, logits=None, probs=None):
        """The ranked scores `select` takes its top k of (`prefix_scores`), from the same arguments."""
        given = prefix_lse if self.softmax_over == "prefix" else lse
        return prefix_scores(q, k, prefix_len=jnp.asarray(kv_len) - q.shape[1], backend=self.backend, lse=given,
                             softmax_over=self.softmax_over, logits=logits, probs=probs)

    def selection(self, state):
        """(indices [B, Hkv, k], exact) of one layer's state: what `dllm_jax.analysis` compares."""
        return state[0].indices, state[1]
