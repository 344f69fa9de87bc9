"""The checkpoint's own tokenizer (`tokenizer.json`, via `tokenizers`) and chat template.

The chat template is the Jinja template the checkpoint ships (`chat_template.jinja`, or the
`chat_template` entry of `tokenizer_config.json`), rendered as transformers does, in a sandbox with time
and size bounds (`dllm_jax.chat_template`). Every problem with these files, when loading or rendering,
is a ValueError whose one-line message names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dllm_jax.chat_template import RenderLimits, compile_template, describe, render

class ChatTokenizer:
    """Encodes prompts (optionally through the chat template) and decodes generated ids."""

    def __init__(self, directory, *, limits: RenderLimits = RenderLimits()):
        self.directory = directory = Path(directory)
        self.tokenizer = read_tokenizer(directory / "tokenizer.json")
        self.config = read_tokenizer_config(directory / "tokenizer_config.json")
        source, self.where = template_source(directory, self.config)
        self.template = compile_template(source, self.where, limits) if source else None

    def special(self, name: str) -> str:
        token = self.config.get(name) or ""
        return token.get("content", "") if isinstance(token, dict) else token

    def render(self, text: str) -> str:
        """The user message through the chat template, ready for the assistant's answer."""
        return self.render_messages([{"role": "user", "content": text}])

    def render_messages(self, messages: list[dict]) -> str:
        """A conversation ([{"role": ..., "content": ...}, ...]) through the chat template, ready for the
        assistant's answer."""
        if self.template is None:
            raise ValueError("this checkpoint ships no chat template; pass chat=False to use the raw prompt")
        return render(self.template, self.where, {"add_generation_prompt": True, "bos_token": self.special("bos_token"),
                                                  "messages": messages, "eos_token": self.special("eos_token")})

    def encode(self, text: str, *, chat: bool = True) -> np.ndarray:
        """int32 [1, P] token ids of `text` (through the chat template if chat=True)."""
        text = unicode_text(text, "the prompt")
        prompt = self.render(text) if chat else text
        ids = self.tokenizer.encode(prompt, add_special_tokens=not chat).ids
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return np.asarray([ids], np.int32)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation through the chat template (`render_messages`)."""
        for message in messages:
            unicode_text(message.get("content"), f"a {message.get('role')} message")
        ids = self.tokenizer.encode(self.render_messages(messages), add_special_tokens=False).ids
        if not ids:
            raise ValueError("the messages encode to no tokens")
        return ids

    def decode(self, ids, *, skip: tuple[int, ...] = ()) -> str:
        """Text of `ids`, without special tokens and without the ids in `skip` (e.g. the mask)."""
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in skip], skip_special_tokens=True)


def unicode_text(text, what: str):
    """`text` if it is a string that UTF-8 can encode; a ValueError naming `what` for one holding a lone surrogate
    (a JSON escape such as "\\ud800", or a command-line argument with bytes that are not UTF-8)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid UTF-8 text: U+{ord(text[e.start]):04X} at character {e.start} is a "
                             "lone surrogate (an undecodable byte, or half of a UTF-16 pair)") from None
    return text


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ValueError(f"{path} not found: text generation needs the checkpoint's tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every kind of bad file
        raise ValueError(f"{path} is not a tokenizers tokenizer.json: {describe(e)}") from None


# the special tokens the chat template is given; each a string, null or an AddedToken {"content": ...}
TEMPLATE_TOKENS = ("bos_token", "eos_token")


def read_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json as a dict ({} when the checkpoint has none)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__} {short(config)}")
    for name in TEMPLATE_TOKENS:
        token = config.get(name)
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{path}: {name} must be a string, null or {{\"content\": string}}, got {short(token)}")
    return config


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def template_source(directory: Path, config: dict) -> tuple[str | None, str]:
    """(the chat template's source or None, where it comes from: its file, for messages)."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return read_text(path), str(path)
    config_path = directory / "tokenizer_config.json"
    where = f"{config_path} (chat_template)"
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        source, name = named_template(source, where)
        where = f"{config_path} (chat_template {name!r})"
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{where} must be a Jinja template (a string) or a list of {{\"name\", \"template\"}}, "
                         f"got {type(source).__name__} {short(source)}")
    return source, where


def named_template(entries: list, where: str) -> tuple[str, object]:
    """(source, name) of the "default" template of a list of {"name", "template"} entries (the first
    entry if none is named so)."""
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("template"), str):
            raise ValueError(f"{where}: entry {number} must be an object with a \"template\" string, got "
                             f"{short(entry)}")
    if not entries:
        raise ValueError(f"{where} is an empty list: give a template or leave chat_template out")
    entry = next((entry for entry in entries if entry.get("name") == "default"), entries[0])
    return entry["template"], entry.get("name", 0)


def left_pad(rows, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids [B, P], int32 attention_mask [B, P]) of token-id sequences of different lengths,
    left-padded with `pad_id` to the longest (P): every row's last prompt token sits at P - 1, where
    generation starts for all rows. The mask is 1 for a token, 0 for padding."""
    rows = [np.asarray(row, np.int32).reshape(-1) for row in rows]
    if not rows or not all(row.size for row in rows):
        raise ValueError(f"left_pad needs one or more non-empty rows, got lengths {[row.size for row in rows]}")
    longest = max(row.size for row in rows)
    ids = np.full((len(rows), longest), pad_id, np.int32)
    mask = np.zeros((len(rows), longest), np.int32)
    for b, row in enumerate(rows):
        ids[b, longest - row.size:] = row
        mask[b, longest - row.size:] = 1
    return ids, mask
