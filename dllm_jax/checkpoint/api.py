"""The checkpoint contract: `convert_hf_checkpoint` and `load_model`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dllm_jax.checkpoint import orbax as orbax_io
from dllm_jax.checkpoint.atomic import (WRITER, check_replaceable, check_separate, clean_stale_siblings,
                                        make_temp_tree, remove_tree, replace_tree)
from dllm_jax.checkpoint.hf import (TARGET_DTYPES, check_regular, file_problem, param_shapes_for, plan_conversion,
                                    read_hf_params, safetensors_files, source_dtype)
from dllm_jax.checkpoint.manifest import (FORMAT_VERSION, MANIFEST, QUANTIZED_FORMAT_VERSION, Manifest, check_versions,
                                          file_checksum, files_under, read_manifest, sync_tree, tree_checksums,
                                          write_manifest)
from dllm_jax.config import read_hf_config
from dllm_jax.families import family_of
from dllm_jax.models.layers import check_execution
from dllm_jax.quantize import check_device, check_quantize, quantize_tree, quantized_shapes, stored_dtypes
from dllm_jax.sharding import check_mesh, shard_params

# Files of an HF checkpoint directory that travel with a conversion (tokenizer, generation defaults).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja")


def convert_hf_checkpoint(hf_dir, out_dir, *, dtype: str | None = None, quantize: str | None = None,
                          overwrite: bool = False, progress: bool = True) -> None:
    """Converts an HF safetensors checkpoint (single file or sharded with an index) to Orbax.

    Nothing is lost and nothing is half-written:
    - out_dir may not be, be inside, or contain the source (hf_dir, or a directory that really
      holds its files: symlinks are resolved); the source is only read.
    - Only the source's own files are read: the shards an index names must lie inside hf_dir by
      name (see `checkpoint.hf.safetensors_files`), side files are checked as `side_files` says,
      and every file read must be a regular file (a FIFO or device would block forever).
    - Every tensor is validated (name, shape, dtype) from the file headers, and out_dir's parent
      is checked writable, before the long read. Tensors holding NaN or Inf are refused.
    - The tree is written into a hidden sibling `.<name>.tmp-<pid>@<host>-<token>`, flushed to
      disk, committed by writing `dllm_jax_manifest.json` last (every file written, a CRC-32 per
      tensor of the stored values, a CRC-32 of config.json and of each side file as written,
      format_version, param_dtype), then renamed to out_dir.
    - overwrite=True replaces only a committed conversion that holds nothing but the files its
      manifest lists (anything else is refused, naming the files); the old tree is renamed aside,
      the new one renamed into place, and the old one removed last. A kill at any point leaves
      out_dir as it was or the new complete tree (or absent between the two renames, both
      complete trees beside it); an error leaves it as it was.
    - Temp and aside trees left by a killed conversion are removed by the next conversion into the
      same parent once their process (the pid in the name) is gone; trees of a live or foreign
      process are reported with a warning, not touched.
    Permissions follow the umask; a copied side file also keeps no permission its source lacks
    (a private 0600 tokenizer file stays 0600).

    Args:
      hf_dir: directory with config.json and *.safetensors.
      out_dir: directory to create (must not exist unless overwrite=True).
      dtype: stored parameter dtype, "bfloat16" or "float32". None (the default) keeps the source
        exact: bfloat16 if every tensor is BF16, else float32 (F32, F16 and mixed checkpoints;
        F16 does not fit bfloat16 without rounding). An explicit "bfloat16" rounds F32 and F16.
      quantize: None (the default), "int8" or "fp8": store the linear layers' weights quantized with a
        float32 scale per output channel (`dllm_jax.quantize`; the family's `quantized` table says which:
        attention, MLP, an untied LM head), the other tensors in bfloat16 (the weights are read as bfloat16 first). Lossy by request: a
        quantized tree records its mode in config.json and the manifest (format_version 3, which older
        versions refuse by name), and loads only as that mode.
      overwrite: replace an existing out_dir (a committed conversion, see above).
      progress: show a tqdm bar over the tensors.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    dtype = checked_dtype(dtype, "convert_hf_checkpoint")
    quantize = check_quantize(quantize, where="convert_hf_checkpoint: quantize")
    if quantize and dtype == "float32":
        raise ValueError(f"convert_hf_checkpoint: quantize={quantize!r} stores the weights in {quantize} and the "
                         "rest in bfloat16 (the dtype a quantized model computes in); dtype='float32' cannot go with "
                         "it: drop dtype, or convert without quantize to keep float32")
    if hf_dir.is_dir():
        check_separate(hf_dir, out_dir, source_files(hf_dir))
    if out_dir.exists() or out_dir.is_symlink():
        if not overwrite:
            raise ValueError(f"{out_dir} already exists (pass overwrite=True, or --overwrite, to replace it)")
        check_replaceable(out_dir)
    check_config_file(hf_dir)
    raw, config = read_hf_config(hf_dir)
    family_of(config).check_quantize(quantize)
    plan = plan_conversion(hf_dir, config)  # fail on a bad checkpoint before creating anything
    sides = side_files(hf_dir)
    dtype = "bfloat16" if quantize else dtype or source_dtype(plan)
    tmp = start_tree(out_dir)
    try:
        params = read_hf_params(hf_dir, config, dtype=dtype, progress=progress)
        if quantize:
            params = quantize_tree(params, family_of(config).quantized, quantize)
        orbax_io.save_params(tmp, params)
        checksums = tree_checksums(params)
        del params
        version = QUANTIZED_FORMAT_VERSION if quantize else FORMAT_VERSION
        raw = dict(raw, dllm_jax={"format_version": version, "param_dtype": dtype}
                   | ({"quantize": quantize} if quantize else {}))
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for source in sides:
            copy_side_file(source, tmp / source.name)
        sync_tree(tmp)
        small = ("config.json", *(source.name for source in sides))
        write_manifest(tmp, Manifest(version, dtype, files_under(tmp, exclude=(WRITER,)), checksums,
                                     file_checksums={name: file_checksum(tmp / name) for name in small},
                                     quantize=quantize))
        replace_tree(tmp, out_dir, overwrite=overwrite)
    except BaseException:
        if tmp.exists():
            with contextlib.suppress(OSError):  # keep the original error; the next conversion cleans up
                remove_tree(tmp)
        raise


def source_files(hf_dir: Path) -> list[Path]:
    """The files a conversion reads: hf_dir's own and the shards its index names (a subfolder may
    link elsewhere). A bad index adds nothing here; reading the checkpoint reports it."""
    files = [p for p in hf_dir.iterdir() if p.is_file()]
    with contextlib.suppress(ValueError):
        found = safetensors_files(hf_dir)
        files += list(found.values()) if isinstance(found, dict) else []
    return files


def check_config_file(directory: Path) -> None:
    """ValueError if config.json is there but not a regular file (an absent one is reported by
    read_hf_config, a FIFO would be reported as absent)."""
    path = directory / "config.json"
    problem = file_problem(path)
    if problem and problem != "does not exist":
        check_regular({path: problem})


def side_files(hf_dir: Path) -> list[Path]:
    """The SIDE_FILES of hf_dir, checked before anything is written; ValueError naming the file.

    A side file is copied byte for byte into the converted tree, so it must belong to the
    checkpoint: once links are followed it must be a regular file inside hf_dir or, when hf_dir is
    a Hugging Face cache snapshot (`<repo>/snapshots/<revision>/`, whose files are links to
    `../../blobs/<hash>`), inside that repository's `<repo>/blobs/`. A link leading anywhere else
    (someone's private file) is refused, and so is a FIFO, socket or device (a copy would block).
    """
    found = []
    home = hf_dir.resolve()
    blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
    for name in SIDE_FILES:
        path = hf_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        check_regular({path: file_problem(path)})
        real = path.resolve()
        if not (real.is_relative_to(home) or (blobs is not None and real.is_relative_to(blobs))):
            raise ValueError(f"side file {path} is a symbolic link to {real}, outside the checkpoint {hf_dir}"
                             f"{f' and its cache blobs {blobs}' if blobs else ''}: refusing to copy it into out_dir "
                             "(copy the file into the checkpoint instead of linking it)")
        found.append(path)
    return found


def copy_side_file(source: Path, dest: Path) -> None:
    """Copies `source` to the new file `dest` as a regular file with the source's permissions, within
    what the umask allows (the kernel masks the mode given to open)."""
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in since the check must not block
    with open(fd, "rb") as src:
        mode = os.fstat(src.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"side file {source} is no longer a regular file: only regular files are read")
        with open(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IMODE(mode) & 0o666), "wb") as dst:
            shutil.copyfileobj(src, dst)


def start_tree(out_dir: Path) -> Path:
    """Creates out_dir's parent and the temp tree beside out_dir, after removing stale temp trees
    there; ValueError naming the path if that place cannot be written."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {out_dir.parent}, the parent of out_dir {out_dir}: "
                         f"{e.strerror or e}") from e
    clean_stale_siblings(out_dir.parent)
    try:
        return make_temp_tree(out_dir)
    except OSError as e:
        raise ValueError(f"cannot write out_dir {out_dir}: creating a directory in {out_dir.parent} failed "
                         f"({e.strerror or e})") from e


def checked_dtype(dtype, function: str) -> str | None:
    """The name of `dtype` (None stays None); ValueError naming the argument unless it is one of
    TARGET_DTYPES (numpy's own "data type not understood" would not say which argument)."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in TARGET_DTYPES:
        raise ValueError(f"{function}: dtype must be one of {sorted(TARGET_DTYPES)} or None, got {dtype!r}")
    return name


def is_converted(path: Path, raw: dict) -> bool:
    """Whether `path` is (or was meant to be) a converted tree, committed or not."""
    return "dllm_jax" in raw or (path / MANIFEST).exists() or (path / orbax_io.PARAMS_DIR).is_dir()


def load_model(path, *, dtype=None, quantize: str | None = None, verify: bool = True, progress: bool = True,
               execution: str = "unrolled", mesh=None):
    """Loads a model from a converted Orbax directory or directly from an HF directory.

    A converted directory must be committed (hold the manifest its conversion writes last) with a
    format_version and param_dtype this version knows, in the manifest and in config.json. With
    verify=True (the default) every tensor's CRC-32 is recomputed from the stored values and
    compared with the manifest, so a damaged or edited data file raises ValueError instead of
    giving NaN logits, and so are the CRC-32s of config.json and the side files (trees converted
    before the manifest recorded them have none to check); verify=False skips both (see
    benchmarks/checkpoint_verify.py for the cost of the tensor pass). Non-finite weights: an HF
    directory is checked tensor by tensor while it is read; a converted tree cannot hold them,
    since conversion refuses them and the checksums prove the values loaded are the values
    converted (with verify=False nothing re-checks them).

    Args:
      path: a directory written by `convert_hf_checkpoint`, or an HF checkpoint directory
        (config.json + *.safetensors, converted in memory).
      dtype: parameter and compute dtype, "bfloat16" (the default when None) or "float32".
      quantize: None (the default), "int8" or "fp8": the linear layers' weights quantized at load with a
        scale per output channel (`dllm_jax.quantize`), computing in bfloat16; "fp8" needs a GPU with FP8
        tensor cores. A tree converted with `quantize` loads as its mode (None or the same value; another
        mode is refused).
      verify: check the checksums of a converted directory (every tensor, config.json, side files).
      progress: show a tqdm bar while converting an HF directory in memory.
      execution: "unrolled" (the default: every layer traced separately, weights read in place at
        near memory bandwidth) or "scan" (one `lax.scan` body over stacked layers: faster to
        compile, slower to run; see dllm_jax.models.layers and the README's compile-time table).
      mesh: a `jax.sharding.Mesh` with a "tp" axis and optionally "dp" and "sp", in any order (an axis it
        lacks has size 1; `dllm_jax.sharding.make_mesh("tp=2")`, or `jax.make_mesh((2,), ("tp",))`): the
        weights are placed Megatron-style over "tp" (the family's `param_axes`, dllm_jax.families) and
        `generate` puts prompt rows over "dp"; None (the default) keeps everything on the default device.
        The weights are loaded on the default device first, then placed.
    Returns:
      The NNX model of config.json's family (`LLaDA`, `SDAR`, `Dream`, `LLaDA2` or `DiffusionGemma`); `model(input_ids)
      -> float32 logits [B, L, V]` (bidirectional for LLaDA and Dream, block-causal for SDAR); DiffusionGemma's
      `model(input_ids, decoder_input_ids, self_conditioning_logits=None)` -> float32 canvas logits [B, C, V], as
      transformers' forward (no quantize, mesh or execution="scan": refused with a ValueError); `model.config`.
    """
    path = Path(path)
    dtype = checked_dtype(dtype, "load_model") or "bfloat16"
    quantize = check_quantize(quantize, where="load_model: quantize")
    check_execution(execution)
    if not path.exists():
        raise ValueError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (load_model takes a checkpoint directory)")
    check_config_file(path)
    raw, config = read_hf_config(path)
    family_of(config).check_quantize(quantize)
    family_of(config).check_mesh(mesh)
    family_of(config).check_execution(execution)
    quantize = check_load_quantize(path, config, quantize, dtype)
    if mesh is not None:  # before reading any weight
        mesh = check_mesh(mesh, config, family_of(config).tp_split)
    if is_converted(path, raw):
        params = load_converted(path, raw, config, dtype, verify=verify)
    elif any(path.glob("*.safetensors")):
        params = to_device_leafwise(read_hf_params(path, config, dtype=dtype, progress=progress))
    else:
        raise ValueError(f"{path} holds neither a converted checkpoint (params/) nor *.safetensors")
    if not config.quantize:
        params, config = quantize_params(params, config, quantize)
    return model_from_params(config, params, execution=execution, mesh=mesh)


def quantize_params(params: dict, config, quantize: str | None):
    """(params, config) with the linear layers of a checkpoint-layout tree quantized as `quantize` says (the
    family's `quantized` table; `dllm_jax.quantize`), in place, and the config saying so; unchanged for None."""
    quantize = check_quantize(quantize)
    if quantize is None:
        return params, config
    if config.quantize:
        raise ValueError(f"the parameters are already quantized ({config.quantize})")
    family_of(config).check_quantize(quantize)
    params = quantize_tree(params, family_of(config).quantized, quantize)
    return params, dataclasses.replace(config, quantize=quantize)


def check_load_quantize(path: Path, config, quantize: str | None, dtype: str) -> str | None:
    """The quantization a load ends with (the tree's own, or `quantize`); ValueError for a mode the device
    cannot run, a quantized tree asked for another mode, or a quantized model asked for float32."""
    if config.quantize and quantize not in (None, config.quantize):
        raise ValueError(f"{path} was converted with quantize={config.quantize!r}; it cannot be loaded as "
                         f"quantize={quantize!r} (its full-precision weights are gone): convert the HF checkpoint "
                         f"with --quantize {quantize}, or load it without quantize")
    quantize = config.quantize or quantize
    if quantize and dtype != "bfloat16":
        held = "holds" if config.quantize else "would hold"
        raise ValueError(f"load_model: the model {held} {quantize} weights and computes in bfloat16; dtype={dtype!r} "
                         f"would compute in {dtype} from the same rounded weights (no closer to the original model, "
                         "and slower): load it without dtype, or load the unquantized checkpoint for float32")
    check_device(quantize)
    return quantize


def load_converted(path: Path, raw: dict, config, dtype: str, *, verify: bool) -> dict:
    """The parameter tree of a committed converted directory, as `dtype`, checksums verified."""
    manifest = read_manifest(path)
    entry = raw.get("dllm_jax")
    if not isinstance(entry, dict):
        raise ValueError(f"{path / 'config.json'} has no dllm_jax entry although {path} holds a conversion; "
                         "convert the HF checkpoint again")
    check_versions(path / "config.json", entry.get("format_version"), entry.get("param_dtype"), entry.get("quantize"))
    if (entry["format_version"], entry["param_dtype"]) != (manifest.format_version, manifest.param_dtype):
        raise ValueError(f"{path}: config.json (format_version {entry['format_version']}, param_dtype "
                         f"{entry['param_dtype']}) disagrees with {MANIFEST} (format_version "
                         f"{manifest.format_version}, param_dtype {manifest.param_dtype}); convert again")
    if manifest.quantize != config.quantize:
        raise ValueError(f"{path}: config.json (quantize {config.quantize!r}) disagrees with {MANIFEST} (quantize "
                         f"{manifest.quantize!r}); convert again")
    stored = manifest.param_dtype
    if config.quantize:  # restored exactly as stored (int8 / fp8 values, float32 scales, the rest bfloat16)
        table = family_of(config).quantized
        shapes = quantized_shapes(param_shapes_for(config), table)
        params = orbax_io.restore_params(path, shapes, stored_dtypes(shapes, table, config.quantize, stored))
        if verify:
            verify_files(path, manifest)
            verify_checksums(path, params, manifest, cast=None)
        return params
    # Checksums are of the stored values: restore in a dtype that holds them exactly (bfloat16 fits
    # float32), then cast to `dtype` tensor by tensor.
    wide = not verify or jnp.dtype(dtype).itemsize >= jnp.dtype(stored).itemsize
    params = orbax_io.restore_params(path, param_shapes_for(config), jnp.dtype(dtype if wide else stored))
    if verify:  # after the restore, whose shape check says more about a config that no longer fits
        verify_files(path, manifest)
        verify_checksums(path, params, manifest, cast=TARGET_DTYPES[stored])
    return cast_leafwise(params, jnp.dtype(dtype))


def verify_checksums(path: Path, params: dict, manifest: Manifest, *, cast) -> None:
    """ValueError naming the checkpoint and every tensor whose stored values changed since conversion
    (`params` as restored, each cast to `cast` first unless None: the stored dtype)."""
    found = tree_checksums(params, chunk_bytes=manifest.chunk_bytes, cast=cast)
    bad = [p for p in set(found) | set(manifest.checksums) if found.get(p) != manifest.checksums.get(p)]
    if bad:
        raise ValueError(f"converted checkpoint {path} is damaged: the stored values of {len(bad)} tensors do "
                         f"not match the checksums written at conversion ({sorted(bad)[:20]}); the files were "
                         "changed after conversion. Convert the HF checkpoint again")


def verify_files(path: Path, manifest: Manifest) -> None:
    """ValueError naming the checkpoint and every small file (config.json, side files) whose bytes
    changed since conversion."""
    changed = []
    for name, expected in sorted(manifest.file_checksums.items()):
        problem = file_problem(path / name)
        if problem or file_checksum(path / name) != expected:
            changed.append(f"{name} ({problem})" if problem else name)
    if changed:
        raise ValueError(f"converted checkpoint {path} is damaged: {', '.join(changed)} changed after conversion "
                         f"(its CRC-32 differs from the one in {MANIFEST}); convert the HF checkpoint again")


def cast_leafwise(tree: dict, dtype) -> dict:
    """Casts a nested dict of device arrays in place, one leaf at a time (each original is dropped
    as its cast is stored: peak is the tree plus one leaf)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            tree[key] = cast_leafwise(value, dtype)
        elif value.dtype != dtype:
            tree[key] = value.astype(dtype)
    return tree


def to_device_leafwise(tree: dict) -> dict:
    """Moves a nested dict of host arrays to the default device in place, one leaf at a time,
    dropping each host copy as it goes (peak: the model once plus one tensor)."""
    for key, value in tree.items():
        tree[key] = to_device_leafwise(value) if isinstance(value, dict) else jax.device_put(value)
    return tree


def model_from_params(config, params: dict, *, execution: str = "unrolled", mesh=None):
    """Builds the model of `config` around an existing parameter tree (checkpoint or inference
    layout; no random init), prepared for inference as `execution` says ("unrolled", the default,
    or "scan": see dllm_jax.models.layers). Takes ownership of `params`: its tensors move into the
    model (the tree is emptied), so a device tree is not held twice. With a `mesh`, the weights are
    placed on it (`dllm_jax.sharding.shard_params`; any mesh `load_model` takes) and the model remembers
    it, over the axes ("dp", "sp", "tp"), as `model.mesh`."""
    family = family_of(config)
    family.check_execution(execution)
    family.check_mesh(mesh)
    dtype = params["embed"].dtype
    params = family.prepare_params(params, config, execution=execution)
    if mesh is not None:
        mesh = check_mesh(mesh, config, family.tp_split)
        params = shard_params(params, family.param_axes, mesh)
    abstract = nnx.eval_shape(lambda: family.model_class(config, dtype=dtype, rngs=nnx.Rngs(0), execution=execution))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, family.to_module_tree(params))
    model = nnx.merge(graphdef, state)
    model.mesh = mesh
    return model
