"""Reading Hugging Face `config.json` values strictly, the shared checks of a config's fields, and `ModelConfig`,
the base of every family's config (what `config_from_hf` and the family registry read of it).

`HFKey` is one row of a family's declarative config map (`DecoderConfig.HF`): a config field, its config.json
key, how the value is read and what an absent (or null) key means. The readers refuse what a loose reader would
misread: numbers written as strings, bools or fractions, a list where an object belongs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dllm_jax.validation import flag, integer, real

REQUIRED = object()  # an HFKey's default: the key must be present

CONFIG_CLASSES: list[type] = []  # every family's config class (a ModelConfig with MODEL_TYPES), in definition order


class ModelConfig:
    """The base of every family's config (a frozen dataclass subclass): what the package reads of any family's.

    Class attributes a family sets: `family` (its name in `dllm_jax.families`), `MODEL_TYPES` / `ARCHITECTURES`
    (the HF `model_type` / `architectures` values it accepts; a class with MODEL_TYPES joins `config_from_hf` by
    being defined); `LABEL` (the display name) is the class name without "Config". Every config has `vocab_size`,
    `pad_token_id`, `max_position_embeddings`, `stop_ids` and `placeholder_ids`, and `from_hf_config(hf)` /
    `to_hf_config()`; `quantize` (None: full-precision weights) is a field where the family can be quantized.
    """

    family = ""
    LABEL = ""
    MODEL_TYPES = ()
    ARCHITECTURES = ()
    quantize = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.LABEL = cls.__name__.removesuffix("Config")
        if cls.MODEL_TYPES:
            CONFIG_CLASSES.append(cls)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end an answer (generation stops, or pads after, the first of them)."""
        raise NotImplementedError

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Token ids that stand for positions not yet decoded (a mask token): left out of decoded text."""
        return ()

    @classmethod
    def check_hf_names(cls, hf) -> None:
        """Refuses a config.json that is not a JSON object, or whose model_type or architectures name another
        model than this family's: its weights would load under the wrong layer definitions."""
        check_object(hf)
        model_type = hf.get("model_type")
        if model_type and str(model_type).lower() not in cls.MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not a {cls.LABEL} model (accepted: "
                             f"{cls.MODEL_TYPES})")
        names = hf_architectures(hf)
        foreign = [a for a in names if a not in cls.ARCHITECTURES]
        if foreign:
            raise ValueError(f"config.json architectures={names!r}: {foreign} is not a {cls.LABEL} architecture "
                             f"(accepted: {list(cls.ARCHITECTURES)})")


@dataclasses.dataclass(frozen=True)
class HFKey:
    """A config field read from a config.json key: `read(hf, key, default)` (`hf_int`, `hf_real`, `hf_flag`, or
    a family's own reader); `default` is REQUIRED, a value, or `derive(hf, fields read so far)` -> the value
    of an absent key (e.g. num_kv_heads = num_heads)."""

    field: str
    key: str
    read: Callable
    default: Any = REQUIRED

    def value(self, hf: dict, fields: dict):
        default = self.default(hf, fields) if callable(self.default) else self.default
        return self.read(hf, self.key, default)


def hf_default(key: str, default):
    """The value of an absent or null key (HF writes null for "the default")."""
    if default is REQUIRED:
        raise ValueError(f"config.json lacks the required key {key!r}")
    return default


def hf_int(hf: dict, key: str, default=REQUIRED):
    """An integer key. JSON writers may print 64 as 64.0, which is accepted; "64", 64.5 and true are not."""
    value = hf.get(key)
    if value is None:
        return hf_default(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return integer(f"config.json key {key!r}", value, minimum=None)


def hf_real(hf: dict, key: str, default=REQUIRED) -> float:
    value = hf.get(key)
    return hf_default(key, default) if value is None else real(f"config.json key {key!r}", value)


def hf_flag(hf: dict, key: str, default=REQUIRED) -> bool:
    value = hf.get(key)
    return hf_default(key, default) if value is None else flag(f"config.json key {key!r}", value)


def hf_dict(hf: dict, key: str) -> dict:
    value = {} if hf.get(key) is None else hf[key]
    if not isinstance(value, dict):
        raise ValueError(f"config.json key {key!r} must be an object or null, got {value!r}")
    return value


def check_required(hf: dict, family: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ValueError(f"{family} config.json lacks required keys {missing}")


def hf_architectures(hf: dict) -> list[str]:
    names = [] if hf.get("architectures") is None else hf["architectures"]
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise ValueError(f"config.json key 'architectures' must be a list of class names, got {names!r}")
    return names


def check_object(hf) -> None:
    if not isinstance(hf, dict):
        kinds = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        kind = kinds.get(type(hf), type(hf).__name__)
        raise ValueError(f"a config.json must hold a JSON object of keys, got {kind}: {hf!r:.80}")


def qwen_refusals(hf: dict, *, moe: bool = True) -> list[str]:
    """What the Qwen-style families (SDAR, Dream, LLaDA2) refuse alike: an activation other than silu,
    mixture-of-experts keys (`moe`: for the dense ones), a sliding window, RoPE scaling."""
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (supported: 'silu')")
    if moe and (hf.get("num_experts") or hf.get("moe_intermediate_size")):
        bad.append("mixture-of-experts layers (num_experts)")
    if hf_flag(hf, "use_sliding_window", False):
        bad.append("use_sliding_window=True")
    rope, params = hf_dict(hf, "rope_scaling"), hf_dict(hf, "rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type != "default":
        bad.append(f"rope scaling {rope_type!r}")
    return bad


# --- the checks a config makes on its own fields ---

def field_label(config, name: str) -> str:
    """`LLaDAConfig.hidden_size (config.json key 'd_model')`: the field and where it comes from."""
    key = config.HF_KEYS.get(name, name)
    return f"{type(config).__name__}.{name}" + (f" (config.json key {key!r})" if key != name else "")


def token_id(label: str, value, vocab_size: int, hint: str = "") -> int:
    value = integer(label, value, minimum=0, hint=hint)
    if value >= vocab_size:
        # the id indexes the embedding and the logits: beyond them it would be clamped silently
        raise ValueError(f"{label}={value} lies beyond the vocabulary (vocab_size={vocab_size}: ids "
                         f"0..{vocab_size - 1}){hint}")
    return value


def check_fields(config, *, sizes: tuple[str, ...]) -> None:
    """Checks the sizes and numbers shared by the families, storing them as canonical int / float /
    bool (frozen dataclass: object.__setattr__), so that a numpy scalar does not make equal configs
    differ as static jit arguments."""
    for name in sizes:
        object.__setattr__(config, name, integer(field_label(config, name), getattr(config, name)))
    for name in ("rope_theta", "rms_norm_eps"):  # zero or negative: NaN or inf activations
        object.__setattr__(config, name, real(field_label(config, name), getattr(config, name), low=0, low_open=True))
    object.__setattr__(config, "tie_word_embeddings",
                       flag(field_label(config, "tie_word_embeddings"), config.tie_word_embeddings))


def check_token_ids(config, names: tuple[str, ...]) -> None:
    for name in names:
        object.__setattr__(config, name, token_id(field_label(config, name), getattr(config, name), config.vocab_size))


def check_mask_distinct(config, special_ids: tuple[int, ...]) -> None:
    """The mask id must not double as a stop or padding token: generated masks would read as stops,
    padding as positions to fill in."""
    if config.mask_token_id in special_ids:
        raise ValueError(f"{type(config).__name__}.mask_token_id={config.mask_token_id} is also a stop or padding "
                         f"token id ({special_ids}); the mask token must be its own id")
