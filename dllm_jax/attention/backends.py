"""The one vocabulary that chooses attention code, and the one place where a choice is resolved.

Every policy (Dense, SparseD, PulseCol, SpargeAttn, MAGE, FlashBlock) has a field `backend` taking a
name from BACKENDS. `dllm_jax.attention.kernels` (the entry layer between the policies and the
`pallas_kernels` entry points) resolves it once per operation, here, into a concrete choice and passes
that down: the kernel entries get "triton" or "mosaic" (never "auto") and do not decide again.

  backend     dense attention (Dense; a method's dense steps)      the Pallas kernel ops of a method
  "auto"      GPU: a block against a KV cache (kv_len, no other     GPU: Mosaic where the kernel has a
              mask, bf16/fp16, a block the tile takes) -> split-KV  Mosaic version that takes the
              kernel (Triton); anything else cuDNN for bf16/fp16    inputs (`mosaic.choose`), Triton
              and head_dim <= 128, XLA otherwise. CPU: XLA          otherwise. CPU: the references
  "reference" the pure-jnp attention (`dense.xla_attention`)        the pure-jnp `<name>_reference`s
  "xla"       the same jnp attention, compiled by XLA (on a CPU in   (refused: use "reference")
              query chunks of 128 rows: `dense.CPU_QUERY_CHUNK`;
              under a long mask, each on a key prefix)
  "cudnn"     cuDNN flash attention (jax.nn.dot_product_attention)  (refused: cuDNN has no sparse kernels)
  "triton"    a KV-cache block -> split-KV kernel (flash for        the Triton kernels
              blocks too long for its tile); no mask -> flash
  "mosaic"    no mask or kv_len only -> the Mosaic flash kernel     Mosaic where the kernel has a Mosaic
              (a ValueError saying why where it cannot run)         version (ValueError where it cannot
                                                                    run), Triton for the others
  "interpret" as "triton", in Pallas interpret mode (CPU tests)     the Triton kernels, interpreted

Calls with a key mask or a block mask (padding, SDAR's block-causal prefill) have no Pallas kernel:
under "triton", "mosaic" and "interpret" they run the dense default (cuDNN on a GPU for bf16/fp16,
XLA otherwise), the same code "auto" runs for them. "reference" and "xla" run the same jnp code for
dense attention; only Dense takes "xla" and "cudnn", the names of `jax.nn.dot_product_attention`
(a sparse method given one is refused with what it means there, `DENSE_ONLY`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic
from pallas_kernels import split_kv as split_kv_kernels

BACKENDS = ("auto", "reference", "xla", "cudnn", "triton", "mosaic", "interpret")
# What a sparse method takes: its estimation and sparse steps are Pallas kernels or their jnp references.
METHOD_BACKENDS = ("auto", "reference", "triton", "mosaic", "interpret")
# Dense attention's names, refused for a sparse method with what it means there.
DENSE_ONLY = {
    "xla": "'reference' (a sparse method's jnp path; 'xla' names dense attention, Dense(backend='xla'))",
    "cudnn": "'auto' (a sparse method's dense steps run cuDNN on a GPU; cuDNN has no sparse kernels)",
}
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check(value, label: str, choices: tuple[str, ...] = BACKENDS) -> str:
    """Raises ValueError naming `label` and the valid choices unless `value` is one of `choices`."""
    if isinstance(value, str) and value in choices:
        return value
    hint = f"; for {value!r} use {DENSE_ONLY[value]}" if isinstance(value, str) and value in DENSE_ONLY else ""
    raise ValueError(f"{label}={value!r} is not one of {choices}{hint}")


def platform(override: str | None = None) -> str:
    """The platform "auto" chooses for: the default backend ("gpu", "cpu", ...) unless overridden
    (tests resolve for a GPU on a CPU machine with override="gpu")."""
    return override or jax.default_backend()


def dense_default(dtype, head_dim: int, *, on: str | None = None) -> str:
    """What "auto" runs for dense attention that no Pallas kernel takes: 'cudnn' on a GPU for
    bf16/fp16 and a head_dim the cuDNN kernel supports, else 'xla' (cuDNN has no fp32 path, so fp32
    numerics runs use XLA)."""
    fits = jnp.dtype(dtype) in HALF_DTYPES and head_dim <= 128 and head_dim % 8 == 0
    return "cudnn" if platform(on) == "gpu" and fits else "xla"


def kernel(backend: str, q, *, mosaic_kernel: bool = False, scale=None, block_q=None, block_kv=None,
           name: str = "attention", on: str | None = None) -> str:
    """The concrete code of one Pallas kernel op: 'reference', 'triton', 'mosaic' or 'interpret'.

    mosaic_kernel: whether the op has a Mosaic GPU version (flash, block-sparse, block mass); q,
    scale, block_q and block_kv are what `mosaic.choose` looks at to see if it takes the inputs.
    """
    check(backend, "backend", METHOD_BACKENDS)
    if backend == "auto":
        if platform(on) != "gpu":
            return "reference"
        backend = "auto" if mosaic_kernel else "triton"
    if backend in ("reference", "interpret", "triton") or not mosaic_kernel:
        return "triton" if backend == "mosaic" else backend  # "mosaic" where no Mosaic version exists: Triton
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # "auto": Mosaic where it takes the inputs; "mosaic": insists (a ValueError naming why it cannot)
    return mosaic.choose(backend, q, scale=scale, interpret=False, triton_knobs=False, name=name, block_q=block_q,
                         block_kv=block_kv)


def dense(backend: str, q, k, *, kv_len=None, key_mask=None, mask=None, on: str | None = None) -> tuple[str, str]:
    """(op, code) of one dense attention call: op "dense" (`dense_attention`, code 'xla' or 'cudnn'),
    "split_kv" or "flash" (a Pallas kernel, code 'triton', 'mosaic' or 'interpret'). A pure function
    of its arguments and the platform: the table in the module docstring."""
    check(backend, "backend")
    masked = key_mask is not None or mask is not None
    cache_block = kv_len is not None and not masked  # a block against a KV cache filled to kv_len
    fits_split = split_kv_kernels.supported_block(q.shape[1], q.shape[2], k.shape[2], q.shape[3])
    if backend == "auto":
        if cache_block and platform(on) == "gpu" and jnp.dtype(q.dtype) in HALF_DTYPES and fits_split:
            return "split_kv", "triton"  # reads the cache near copy bandwidth; cuDNN at a fraction of that
        return "dense", dense_default(q.dtype, q.shape[-1], on=on)
    if backend in ("reference", "xla"):
        return "dense", "xla"
    if backend == "cudnn":
        return "dense", "cudnn"
    if masked:  # no Pallas kernel takes a key mask or a block mask
        return "dense", dense_default(q.dtype, q.shape[-1], on=on)
    if backend == "mosaic":
        return "flash", "mosaic"
    return ("split_kv" if cache_block and fits_split else "flash"), backend
