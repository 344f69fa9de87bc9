"""The model families: one frozen entry per family (LLaDA, SDAR, Dream, LLaDA2, DiffusionGemma) naming everything
the rest of the package looks up about it, so that no module branches on a config or model class.

A family's *name* ("llada", "sdar", "dream", "llada2", "diffusiongemma") is its key here and its config's
`family`; its *label* ("LLaDA", ...) is the display name the messages use (`family_named` accepts either). Lookups:
`family_of(config_or_model)`, `model_family(model)` (models only), `family_named(name)`, `FAMILIES`
(name -> entry), `family_for_kind`.

Layering: this module imports the config base, the models' shared layouts and the attention methods; each family's
entry is defined in its generate module (`dllm_jax.generate.sdar.FAMILY`, ...), which imports this module, and
`FAMILIES` lists those modules by path, importing them at the first lookup (as vLLM's model registry does), so
the registry sits below `dllm_jax.generate` and what looks families up above both.

Adding a family: its config class (a `dllm_jax.hf_config.ModelConfig` subclass, usually a
`dllm_jax.config.DecoderConfig`, which `config_from_hf` then knows by its MODEL_TYPES / ARCHITECTURES), its model
module (the model class, `param_shapes`, its HF name map in `dllm_jax.models.hf_names`), its generate module
(options class, `prepare`, `run`, `probe_loop`, optionally `eval_options`, and its `FAMILY` entry), listed in
`FAMILIES` below; or, outside the package, the config
subclass and model class in a module of one's own and the entry given to `register` there (reusing an existing
family's generate module: the command line, server and benchmarks find everything else through the entry).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, Callable

from dllm_jax.attention import methods
from dllm_jax.attention.policy import AttentionPolicy, Dense, check_policy
from dllm_jax.hf_config import ModelConfig
from dllm_jax.models import hf_names, layers

LIKELIHOODS = ("masked", "block")
# what tensor parallelism splits over "tp" in every family (the KV heads, the MLP, the vocabulary)
TP_SPLIT = ("num_kv_heads", "intermediate_size", "vocab_size")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Family:
    """Everything the package looks up about one model family (compared and hashed by identity: an entry
    is the family, and its tables, e.g. `param_axes`, are dicts)."""

    name: str  # the registry key; the config's `family`
    config_class: type[ModelConfig]
    model_class: type  # built by dllm_jax.checkpoint.model_from_params around a parameter tree
    # generation (dllm_jax.generate): its options dataclass; prepare(model, prompt_ids, attention_mask, method,
    # options) checks a request before anything compiles; run(model, prompt_ids, attention_mask, seed, method,
    # progress, return_nfe, options) is `generate` for the family; probe_loop(model, prompt_ids, method,
    # options) -> ProbeLoop is the loop dllm_jax.analysis probes
    options_class: type
    prepare: Callable
    run: Callable
    probe_loop: Callable
    answer_option: str  # generate's option giving the answer length
    # the values of its options' `remasking` that are inputs of the compiled loop (`RowSampling.remasking` indexes
    # them), so one program serves them all and a serving request may choose among them; () where none is
    remasking: tuple[str, ...] = ()
    # which attention methods apply and which analysis probes it (dllm_jax.attention.methods.KINDS):
    # BIDIRECTIONAL (full-sequence steps: `analyze`), BLOCK (block steps over a KV cache: `analyze_blocks`) or
    # CANVAS (canvases denoised against an encoder's cache: MAGE applies; nothing to analyze)
    method_kind: str
    # checkpoints: checkpoint-layout shapes of a config, the HF name map, and (None: one tensor per rule and
    # layer) the function giving {HF name: (rule, index, shape)} where tensors are stacked differently
    param_shapes: Callable[[Any], dict]
    hf_rules: tuple[hf_names.Rule, ...]
    hf_expected: Callable[[Any, dict], dict] | None = None
    # names (regexes, whole-name matches) of tensors a checkpoint may hold that the model does not read (a vision
    # tower, copies tied to tensors it reads); any other tensor outside the expected ones is refused
    hf_skipped: tuple[str, ...] = ()
    # checkpoint layout -> inference layout, and inference tree -> nnx pure dict (dllm_jax.models.layers's), for
    # the layer executions it has (`load_model(execution=)`)
    executions: tuple[str, ...] = layers.EXECUTIONS
    prepare_params: Callable = layers.prepare_params
    to_module_tree: Callable = layers.to_module_tree
    # weight quantization (dllm_jax.quantize): the checkpoint-layout tensors quantized, nested like the tree,
    # each with the axes its GEMM contracts; None where the family's weights are not quantized (refused)
    quantized: dict | None = dataclasses.field(default_factory=lambda: layers.QUANTIZED)
    # sharding (dllm_jax.sharding): logical axes per inference-layout parameter (None: not sharded, a mesh is
    # refused), and the config sizes "tp" splits
    param_axes: dict | None
    tp_split: tuple[str, ...] = TP_SPLIT
    # evaluation (dllm_jax.eval.evaluate): greedy one-token-per-step options for an answer length, or None
    # where evaluate has no defaults for the family (refused)
    eval_options: Callable[[int, Any, dict], dict] | None = None
    # the lm-evaluation-harness model's log-likelihood estimate (dllm_jax.eval.likelihood): LIKELIHOODS[0], "masked"
    # (the whole answer masked at once: masked diffusion), LIKELIHOODS[1], "block" (block by block, each given the
    # clean positions before it: block diffusion), or None where it has none (refused)
    likelihood: str | None = None
    # the config field holding a tuple of stop ids that may be empty (config.stop_ids reads every family's)
    stops_field: str | None = None
    # serving (dllm_jax.serve): the pieces of its block loop the slot engine needs, or None where requests are
    # served in lockstep `generate` batches (the bidirectional families, DiffusionGemma)
    slots: Any = None  # a dllm_jax.generate.block_loop.SlotLoop
    # whether `run` takes a seed per row (a sequence of ints, each row generated as alone with its own), so the
    # lockstep server batches sampled requests, each with its seed
    row_seeds: bool = False

    def __post_init__(self):
        if self.method_kind not in methods.KINDS:
            raise ValueError(f"{self.name}: method_kind={self.method_kind!r} is not one of {methods.KINDS}")
        if self.likelihood not in (None, *LIKELIHOODS):
            raise ValueError(f"{self.name}: likelihood={self.likelihood!r} is not None or one of {LIKELIHOODS}")
        if self.config_class.family != self.name:
            raise ValueError(f"{self.config_class.__name__}.family={self.config_class.family!r} is not {self.name!r}")

    @property
    def label(self) -> str:
        return self.config_class.LABEL

    @property
    def model_types(self) -> tuple[str, ...]:
        """The HF `model_type` values config_from_hf reads as this family."""
        return self.config_class.MODEL_TYPES

    @property
    def architectures(self) -> tuple[str, ...]:
        return self.config_class.ARCHITECTURES

    @property
    def sampler(self) -> str:
        """The label of the family whose sampler this entry runs: its own, or where it reuses another family's
        options class (a family registered from outside the package), that family's. The command line's
        flags and checks follow the sampler."""
        return next(f.label for f in FAMILIES.values() if f.options_class is self.options_class)

    @property
    def methods(self) -> list[str]:
        """The names of the sparse-attention methods that apply (`make_method`; "dense" always does)."""
        return methods.method_names(self.method_kind)

    @property
    def sequence_parallel(self) -> bool:
        """Whether a mesh's "sp" axis splits its forwards (the full-sequence ones only)."""
        return self.method_kind == methods.BIDIRECTIONAL

    def check_method(self, method) -> None:
        """ValueError if `method` is a published method of the other kind, naming the ones that apply."""
        methods.check_method(method, self.method_kind, self.label)

    def policy(self, method) -> AttentionPolicy:
        """`generate`'s `method=` as a checked attention policy of this family: None is dense attention, a name
        the method with its defaults (`make_method`), a policy itself."""
        policy = methods.make_method(method) if isinstance(method, str) else Dense() if method is None else method
        check_policy(policy)
        self.check_method(policy)
        return policy

    def check_quantize(self, quantize) -> None:
        """ValueError where weights are to be quantized (`quantize` not None) and the family's are not."""
        if quantize is not None and self.quantized is None:
            raise ValueError(f"quantize={quantize!r}: {self.label} weights cannot be quantized (the family has no "
                             "quantized layout of its tensors): convert or load it without quantize")

    def check_execution(self, execution: str) -> None:
        """ValueError for a layer execution the family's model does not have (checked before any weight is read)."""
        layers.check_execution(execution)
        if execution not in self.executions:
            raise ValueError(f"execution={execution!r}: {self.label} runs its layers {' or '.join(self.executions)} "
                             "only (its layers differ in shape, so no scan body holds them all)")

    def check_mesh(self, mesh) -> None:
        """ValueError where a mesh is given and the family's weights have no sharding axes."""
        if mesh is not None and self.param_axes is None:
            raise ValueError(f"{self.label} weights cannot be sharded over a mesh (the family has no sharding axes "
                             "of its tensors): load it without mesh (--mesh)")

    def without_stops(self, config):
        """`config` generating to its full length (no stop id: benchmarks of random weights, which would stop
        at a random eos), where the family's stop ids may be none (`stops_field`); otherwise unchanged."""
        return config if self.stops_field is None else dataclasses.replace(config, **{self.stops_field: ()})


class Registry(Mapping):
    """name -> Family, in registration order. The package's own entries are each defined in their family's
    generate module (its `FAMILY`), listed here by module path and imported at the first lookup, so this module
    imports no generate module (the generate package looks families up here); `register` adds entries from
    outside the package."""

    def __init__(self, modules: dict[str, str]):
        self._modules = dict(modules)
        self._entries: dict[str, Family] = {}

    def _loaded(self) -> dict[str, Family]:
        if any(name not in self._entries for name in self._modules):  # the first lookup: the package's own first
            self._entries = {name: importlib.import_module(path).FAMILY for name, path in self._modules.items()}
        return self._entries

    def __getitem__(self, name: str) -> Family:
        return self._loaded()[name]

    def __iter__(self):
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def add(self, family: Family) -> None:
        self._loaded()[family.name] = family


# the package's families: name -> the module defining its entry as FAMILY
FAMILIES = Registry({"llada": "dllm_jax.generate.llada", "sdar": "dllm_jax.generate.sdar",
                     "dream": "dllm_jax.generate.dream", "llada2": "dllm_jax.generate.llada2",
                     "diffusiongemma": "dllm_jax.generate.diffusion_gemma"})


def register(family: Family) -> Family:
    """Adds `family` to the registry (a family defined outside the package: its config subclass, its model class
    and this entry, in a module of its own; see the module docstring) and returns it. ValueError where its name,
    config class, model class or HF model types are another entry's."""
    for other in FAMILIES.values():
        clash = (["name"] * (other.name == family.name) + ["config class"] * (other.config_class is family.config_class)
                 + ["model class"] * (other.model_class is family.model_class)
                 + ["HF model types"] * bool(set(other.model_types) & set(family.model_types)))
        if clash:
            raise ValueError(f"family {family.name!r}: its {' and '.join(clash)} already belong to {other.label}")
    FAMILIES.add(family)
    return family


def family_named(name: str) -> Family:
    """The family called `name`: its registry name or its label, in any case ("llada2", "LLaDA2")."""
    family = FAMILIES.get(str(name).lower()) if isinstance(name, str) else None
    if family is None:
        raise ValueError(f"unknown model family {name!r}; known: {[f.label for f in FAMILIES.values()]}")
    return family


def family_of(thing) -> Family:
    """The family of a config or model (by its `config`), or of a config or model class."""
    if isinstance(thing, type):
        found = [f for f in FAMILIES.values() if thing in (f.config_class, f.model_class)]
    else:
        config = thing if isinstance(thing, ModelConfig) else getattr(thing, "config", None)
        found = [f for f in FAMILIES.values() if type(config) is f.config_class]
    if not found:
        what = thing.__name__ if isinstance(thing, type) else type(thing).__name__
        raise ValueError(f"{what} is not a model or config of a known family "
                         f"({', '.join(f.label for f in FAMILIES.values())})")
    return found[0]


def family_of_model(model) -> Family | None:
    """The family whose model class `model` is an instance of, or None (a config, or any other object)."""
    return next((family for family in FAMILIES.values() if type(model) is family.model_class), None)


def model_family(model, caller: str = "generate") -> Family:
    """The family whose model class `model` is an instance of; ValueError naming `caller` and the
    families otherwise (a config, or any other object)."""
    family = family_of_model(model)
    if family is not None:
        return family
    labels = [f.label for f in FAMILIES.values()]
    raise ValueError(f"{caller} supports {', '.join(labels[:-1])} and {labels[-1]} models, got {type(model).__name__}")


def family_for_kind(kind: str) -> list[Family]:
    """The families whose method kind is `kind` (one of dllm_jax.attention.methods.KINDS)."""
    return [f for f in FAMILIES.values() if f.method_kind == kind]


__all__ = ["FAMILIES", "Family", "family_for_kind", "family_named", "family_of", "model_family", "register"]
