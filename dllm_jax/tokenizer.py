"""The checkpoint's own tokenizer (`tokenizer.json`, via `tokenizers`) and chat template.

The chat template is the Jinja template the checkpoint ships (`chat_template.jinja`, or the
`chat_template` entry of `tokenizer_config.json`), rendered with jinja2 as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer


class ChatTokenizer:
    """Encodes prompts (optionally through the chat template) and decodes generated ids."""

    def __init__(self, directory):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: text generation needs the checkpoint's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = directory / "chat_template.jinja"
        source = template_path.read_text() if template_path.is_file() else self.config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), source[0]["template"])
        self.template = None
        if source:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(source)

    def special(self, name: str) -> str:
        token = self.config.get(name) or ""
        return token.get("content", "") if isinstance(token, dict) else token

    def render(self, text: str) -> str:
        """The user message through the chat template, ready for the assistant's answer."""
        if self.template is None:
            raise ValueError("this checkpoint ships no chat template; pass chat=False to use the raw prompt")
        return self.template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                                    bos_token=self.special("bos_token"), eos_token=self.special("eos_token"))

    def encode(self, text: str, *, chat: bool = True) -> np.ndarray:
        """int32 [1, P] token ids of `text` (through the chat template if chat=True)."""
        prompt = self.render(text) if chat else text
        ids = self.tokenizer.encode(prompt, add_special_tokens=not chat).ids
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return np.asarray([ids], np.int32)

    def decode(self, ids, *, skip: tuple[int, ...] = ()) -> str:
        """Text of `ids`, without special tokens and without the ids in `skip` (e.g. the mask)."""
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in skip], skip_special_tokens=True)


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
