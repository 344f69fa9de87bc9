"""The word-level tokenizer of the synthetic task suite (`dllm_jax.eval.tasks`).

A fixed vocabulary, in a fixed order (so ids never change between runs or machines): the special
tokens, the digits 0-9 (numbers are written digit by digit, so every passkey or value is
representable), punctuation, the task templates' words, the multi-key needles' keys, the variable
names, and filler words for the haystacks. The groups are disjoint: a key or a template word never
occurs in filler text, so every task's answer is unambiguous.

The tokenizer is `tokenizers`' WordLevel model behind a whitespace pre-tokenizer that also splits
digits apart ("40712" -> 4 0 7 1 2); decoding joins tokens with single spaces.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from dllm_jax.files import write_atomic

PAD, MASK, EOS, UNK = "<pad>", "<mask>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, MASK, EOS, UNK)
DIGITS = tuple("0123456789")
PUNCTUATION = (".", "?", ":", "=", ",")
# every word of the task templates (tasks.py); none of them appears in filler text
TEMPLATE_WORDS = ("the", "pass", "key", "is", "remember", "it", "what", "special", "magic", "number", "for",
                  "VAR", "value", "of", "copy", "reverse", "answer")
# the keys of niah_multikey's needles
KEYS = tuple("""
apple banana cherry lemon mango olive peach plum grape melon walnut almond falcon eagle heron raven
otter badger beaver bison camel cobra coyote dolphin ferret gecko hippo jackal koala lemur lynx moose
panda parrot pelican puma rabbit salmon shark tiger turtle viper walrus zebra anchor barrel candle
compass crystal dagger hammer helmet lantern mirror needle pillar ribbon saddle trumpet violin whistle
kettle""".split())
# variable_tracking's variable names: A..Z and AA..ZZ (upper case: no filler word is upper case)
LETTERS = tuple(chr(c) for c in range(ord("A"), ord("Z") + 1))
VARIABLES = LETTERS + tuple(2 * letter for letter in LETTERS)
FILLER_WORDS = tuple("""
a an and but or so yet to in on at by with from as was were are be been has had have this that these
those they we you he she his her their our my your not no then when where while after before over under
through into about around near far up down out off again once here there all some many few each every
both more most other such only own same very just also still even ever never often always sometimes soon
later early today tonight tomorrow yesterday morning evening night day week month year season spring
summer autumn winter rain snow wind storm cloud sky sun moon star light dark shadow river lake sea ocean
wave shore island hill mountain valley field forest tree leaf branch root flower grass garden stone rock
sand dust road path bridge gate door window wall roof floor room house home town city village street
market shop school library office farm barn mill tower castle church station harbor ship boat train car
wagon bicycle horse dog cat bird fish cow sheep goat duck mouse fox wolf bear deer owl bee ant child man
woman friend family teacher farmer baker sailor doctor writer painter singer traveler neighbor stranger
king queen soldier guard book letter story song poem picture map page word name voice sound music bell
clock table chair bed cup plate bowl bread cheese milk water tea soup cake fruit salt sugar oil fire
smoke coat hat shoe bag box basket rope chain coin paper pen ink brush paint color red blue green yellow
white black brown gray golden silver old new young small large tall short long wide narrow warm cold
quiet loud soft hard bright heavy thin thick sharp round dry wet deep gentle slow quick happy sad calm busy
tired clean empty full
open closed simple strange walks runs sits stands sleeps wakes reads writes sings talks listens watches
waits carries brings finds keeps leaves builds paints cooks grows falls rises turns opens closes follows
crosses visits returns moves rests slowly quickly quietly softly gladly nearly rarely together alone
along across behind beside between toward without within beyond
""".split())

VOCABULARY = SPECIAL_TOKENS + DIGITS + PUNCTUATION + TEMPLATE_WORDS + KEYS + VARIABLES + FILLER_WORDS
VOCAB_SIZE = len(VOCABULARY)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids of the special tokens: write model configs with them (LLaDA: mask_token_id=mask,
    eos_token_id=eos, pad_token_id=pad, eot_token_id=eos; SDAR: mask_token_id=mask,
    eos_token_ids=(eos,), pad_token_id=pad)."""

    pad: int
    mask: int
    eos: int
    unk: int


SPECIAL_IDS = SpecialIds(*(VOCABULARY.index(token) for token in SPECIAL_TOKENS))  # pad 0, mask 1, eos 2, unk 3

# Saved next to tokenizer.json: the special tokens by role, and a chat template that adds nothing (the
# tasks are plain text), so `dllm-jax generate` encodes a task prompt as it is, with or without --raw.
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS,
                    "pad_token": PAD, "mask_token": MASK, "unk_token": UNK,
                    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}


def build_tokenizer(directory=None) -> Tokenizer:
    """The task suite's tokenizer (ids: the positions in VOCABULARY). With `directory`, also writes
    tokenizer.json and tokenizer_config.json there (created if missing), loadable by
    `load_tokenizer` and `dllm_jax.tokenizer.ChatTokenizer`; each file is written whole or not at all
    (`dllm_jax.files.write_atomic`)."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCABULARY)}, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                       pre_tokenizers.Digits(individual_digits=True)])
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # never split, and dropped by decode(skip_special_tokens)
    if directory is not None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / "tokenizer.json", tokenizer.to_str(pretty=True))  # what Tokenizer.save writes
        write_atomic(directory / "tokenizer_config.json", json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    return tokenizer


def load_tokenizer(directory) -> Tokenizer:
    """The tokenizer.json of a checkpoint directory."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: the task suite needs the checkpoint's tokenizer.json "
                         "(dllm_jax.eval.build_tokenizer writes one)")
    return Tokenizer.from_file(str(path))


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The special token ids of `tokenizer` (SPECIAL_IDS for `build_tokenizer`'s); ValueError naming
    the special tokens it lacks."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    missing = [token for token, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token: the task suite needs its special "
                         f"tokens {SPECIAL_TOKENS} (use dllm_jax.eval.build_tokenizer)")
    return SpecialIds(*ids.values())
