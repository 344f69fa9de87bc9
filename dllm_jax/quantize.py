"""Weight quantization of the linear layers: int8 (any device) and FP8 e4m3 (GPUs with FP8 tensor cores).

Decoding a dLLM at small batch reads every weight once per forward, so storing the weights in one byte halves
the bytes that bound its speed. Each quantized weight holds its values in the storage dtype and one float32
scale per output channel, `<name>_scale`: w ~= values * scale over the output axes, the scale being the
channel's largest magnitude over the representable maximum (127 for int8, 448 for e4m3). Per output channel
keeps the fused inference layout exact: fusing q/k/v or gate/up concatenates columns, and their scales
concatenate the same way (`dllm_jax.models.layers.fuse_layers`). In the inference layout a quantized weight
is stored transposed, [..., out, in] (`transpose_quantized`): the contracted axis minor, which FP8 tensor-core
GEMMs require and which also makes the weight-only GEMMs faster at decode shapes.

Which tensors: the projections of attention and MLP and an untied LM head (each family's `Family.quantized`
table names them in the checkpoint layout with the axes a GEMM contracts). Norms, the embedding table (a
gather; also the head where tied) and LLaDA2's router stay in the parameter dtype. LLaDA2's routed experts are
quantized per expert and output channel and multiplied by the grouped-GEMM kernel, which casts their tiles in
registers (`pallas_kernels.grouped_matmul`'s w_scale; `jax.lax.ragged_dot` of the cast weights elsewhere).

The GEMM (`linear`, gemm="auto"), chosen by the rows it multiplies (static under jit):
  * below `W8A8_MIN_ROWS` rows: weight-only in XLA. The weight is cast to the activations' dtype inside the
    jitted function and the scale applied to the GEMM's float32 output; XLA:GPU fuses the cast into its
    Triton GEMM's operand load, so the GEMM reads the 1-byte values and the cast is never a tensor in
    memory. At decode's few rows this is bandwidth-bound, which is the point. A Pallas kernel for the same
    (`pallas_kernels.quantized_matmul`, up to 16 rows) is not used: end to end, SDAR-8B batch-1 generation
    runs slower with it than through XLA alone (`benchmarks/quantized_gemm.py` keeps the comparison).
  * from `W8A8_MIN_ROWS` rows (prefill, LLaDA's full forwards, large batches): the activations are quantized
    too, per row on the fly (each row's absmax onto the storage range), and the GEMM runs on the 1-byte
    tensor cores (int8 x int8 -> int32, or FP8 x FP8 -> float32), both scales applied to its product, because
    the weight-only GEMM is compute-bound there and slower than bf16.

The measurements behind these choices are in docs/quantization.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


MODES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# the largest magnitude each storage dtype holds (e4m3fn: 448; int8 symmetric: 127, -128 unused)
LIMITS = {"int8": 127.0, "fp8": 448.0}
SCALE = "_scale"
# CUDA compute capability from which a GPU has FP8 tensor cores (Ada 8.9, Hopper 9.0 and later)
FP8_CAPABILITY = (8, 9)
# rows of activations from which the activations are quantized too and the GEMM runs on 1-byte tensor cores
# (module docstring; on an H100 weight-only and FP8 x FP8 GEMMs take the same time at 64 rows)
W8A8_MIN_ROWS = 128
# what `linear` runs: "auto" (module docstring), "xla" (weight-only, XLA's GEMM), "w8a8"
GEMMS = ("auto", "xla", "w8a8")
# XLA options of a program whose every GEMM is FP8 x FP8 (`cublas_gemms`): XLA:GPU otherwise autotunes a Triton
# fusion for each FP8 GEMM, a search that takes minutes at wide batches (SDAR-8B generation at batch 64 on an H100:
# over 310 s compiling, against 38 s with cuBLAS's FP8 GEMMs). Triton's fusions pay only for the weight-only GEMMs
# (the cast fused into the operand load: 3.8x faster at batch 1 than without), which such a program has none of.
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def scale_name(name: str) -> str:
    return name + SCALE


def is_scale(name: str) -> bool:
    return name.endswith(SCALE)


def check_quantize(quantize, *, where: str = "quantize") -> str | None:
    """`quantize` if it is None or a known mode; ValueError naming the value otherwise."""
    if quantize is None or (isinstance(quantize, str) and quantize in MODES):
        return quantize
    raise ValueError(f"{where}={quantize!r} is not one of {[None, *MODES]} (int8: weights in int8 with per-channel "
                     "scales, any device; fp8: e4m3 weights, GPUs with FP8 tensor cores)")


def check_device(quantize: str | None, device=None) -> None:
    """ValueError if `quantize` needs what `device` (the default device when None) lacks: FP8 tensor cores."""
    if quantize != "fp8":
        return
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability and tuple(int(c) for c in capability.split(".")) >= FP8_CAPABILITY:
        return
    raise ValueError(f"quantize='fp8' needs a GPU with FP8 tensor cores (compute capability >= "
                     f"{'.'.join(map(str, FP8_CAPABILITY))}: Ada, Hopper, Blackwell); this device is "
                     f"{device.device_kind} ({device.platform}{', ' + capability if capability else ''}). "
                     "Use quantize='int8' (any device) instead")


def output_axes(ndim: int, contracted: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contracted)


def quantize_weight(w, contracted: tuple[int, ...], mode: str):
    """(values in MODES[mode], float32 scale over w's other axes) of w, the absmax over `contracted` (the
    axes a GEMM sums over) mapped onto the storage range. An all-zero channel gets scale 1 (values 0)."""
    w = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / LIMITS[mode], 1.0)
    scaled = w / scale
    if mode == "int8":
        values = jnp.clip(jnp.round(scaled), -LIMITS[mode], LIMITS[mode]).astype(jnp.int8)
    else:  # e4m3 rounds to nearest; |scaled| <= 448 by construction, so nothing saturates
        values = scaled.astype(MODES[mode])
    return values, jnp.squeeze(scale, axis=contracted)


def dequantize(values, scale, contracted: tuple[int, ...], dtype=jnp.float32):
    """values * scale broadcast back over the contracted axes (the weight a quantized tensor stands for)."""
    return (values.astype(jnp.float32) * jnp.expand_dims(scale, contracted)).astype(dtype)


quantize_jit = jax.jit(quantize_weight, static_argnums=(1, 2))  # one compiled program per shape, reused


def quantize_tree(params: dict, table: dict, mode: str) -> dict:
    """Quantizes in place the tensors `table` names ({name: contracted axes}, nested like `params`; a
    subtree `params` lacks is skipped), each replaced by its values and `<name>_scale` one tensor at a time
    (peak: the tree plus one tensor in float32). Returns `params`."""
    for name, entry in table.items():
        if name not in params:
            continue
        if isinstance(entry, dict):
            quantize_tree(params[name], entry, mode)
            continue
        weight = params.pop(name)
        params[name], params[scale_name(name)] = quantize_jit(weight, entry, mode)
        del weight
    return params


def quantized_shapes(shapes: dict, table: dict) -> dict:
    """`shapes` (a nested {name: shape} tree) with `<name>_scale` added beside every tensor `table` names."""
    out = {}
    for name, shape in shapes.items():
        entry = table.get(name)
        if isinstance(shape, dict):
            out[name] = quantized_shapes(shape, entry if isinstance(entry, dict) else {})
            continue
        out[name] = shape
        if entry is not None:
            out[scale_name(name)] = tuple(shape[a] for a in output_axes(len(shape), entry))
    return out


def stored_dtypes(shapes: dict, table: dict, mode: str | None, dtype) -> dict:
    """The dtype of every tensor of a (quantized) shape tree: MODES[mode] for the tensors `table` names,
    float32 for their scales, `dtype` for the rest."""
    out = {}
    for name, shape in shapes.items():
        entry = table.get(name)
        if isinstance(shape, dict):
            out[name] = stored_dtypes(shape, entry if isinstance(entry, dict) else {}, mode, dtype)
        elif mode is not None and entry is not None:
            out[name] = jnp.dtype(MODES[mode])
        elif mode is not None and is_scale(name) and table.get(name.removesuffix(SCALE)) is not None:
            out[name] = jnp.dtype(jnp.float32)
        else:
            out[name] = jnp.dtype(dtype)
    return out


def quantized_inference_shapes(shapes: dict, names: tuple[str, ...]) -> dict:
    """One inference-layout layer's `shapes` as quantized: each weight of `names` [..., in, out] stored
    transposed [..., out, in], with its `<name>_scale` [..., out]."""
    out = dict(shapes)
    for name in (n for n in names if n in shapes):
        *lead, fan_in, fan_out = shapes[name]
        out[name] = (*lead, fan_out, fan_in)
        out[scale_name(name)] = (*lead, fan_out)
    return out


def transpose_quantized(layer: dict) -> dict:
    """`layer` (an inference-layout dict) with every quantized weight, one whose `<name>_scale` it holds,
    turned from [..., in, out] to the stored [..., out, in]."""
    return {name: jnp.swapaxes(w, -1, -2) if scale_name(name) in layer else w for name, w in layer.items()}


def gemm_choice(gemm: str, x) -> str:
    """What `linear` runs for x [..., in] @ a quantized weight: "w8a8" or "xla" (weight-only in XLA); `gemm` one of
    GEMMS, "auto" resolved by the rows as the module docstring says. ValueError for an unknown name."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
    if gemm == "auto":
        return "w8a8" if x.size // x.shape[-1] >= W8A8_MIN_ROWS else "xla"
    return gemm


def cublas_gemms(quantize: str | None, min_rows: int) -> bool:
    """Whether a program whose GEMMs multiply at least `min_rows` rows of activations by `quantize` weights is
    compiled with CUBLAS_GEMMS: FP8 weights, every GEMM past W8A8_MIN_ROWS (so FP8 x FP8, none weight-only)."""
    return quantize == "fp8" and min_rows >= W8A8_MIN_ROWS


def linear(x, p: dict, name: str, *, precision=None, gemm: str = "auto"):
    """x [..., in] @ p[name] in x's dtype. An unquantized weight is [in, out]; a quantized one (p holds
    `<name>_scale`) is stored [out, in] and multiplied by the GEMM `gemm` names (GEMMS; the module docstring)."""
    w = p[name]
    scale = p.get(scale_name(name))
    if scale is None:
        return jnp.matmul(x, w, precision=precision)
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    choice = gemm_choice(gemm, x)
    if choice == "w8a8":
        mode = "int8" if w.dtype == jnp.int8 else "fp8"
        xq, row_scale = quantize_weight(x, (x.ndim - 1,), mode)  # per row: its absmax onto the storage range
        product = jnp.int32 if mode == "int8" else jnp.float32
        out = jax.lax.dot_general(xq, w, contract, preferred_element_type=product)
        out = out.astype(jnp.float32) * row_scale[..., None]
    else:
        out = jax.lax.dot_general(x, w.astype(x.dtype), contract, precision=precision,
                                  preferred_element_type=jnp.float32)
    return (out * scale).astype(x.dtype)
