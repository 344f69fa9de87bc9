"""Prompts for batched generation: a prompts file read as a stream, and batches formed as they are needed.

`file_prompts` reads a prompts file line by line (never whole): UTF-8, a leading byte-order mark dropped,
lines ended by "\\n" or "\\r\\n" only, blank lines skipped, each line at most `max_bytes` long (so an endless
file such as /dev/zero ends in an error, not in a read that never returns). A carriage return that ends
no line is refused: a file of old Mac line ends would otherwise be read as one long prompt.
`prompt_batches` groups consecutive encoded prompts into batches as large as a `fits` rule allows,
reading a prompt only to fill a batch with room for it (a full batch is returned before the next is read).
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import itertools
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a generate call."""

    number: int  # 1, 2, ...: its place among the prompts (blank lines not counted): the answer's number
    where: str | None  # how an error names it ("prompt 2 of 3", "--prompts-file p.txt line 7"); None: the only one
    text: str


def flag_prompts(texts: list[str]) -> Iterator[Prompt]:
    """The prompts of a repeated --prompt flag."""
    for number, text in enumerate(texts, 1):
        yield Prompt(number, None if len(texts) == 1 else f"prompt {number} of {len(texts)}", text)


def file_prompts(file: BinaryIO, name: str, max_bytes: int) -> Iterator[Prompt]:
    """The prompts of a prompts file opened in binary mode, read as they are asked for (module docstring);
    `name` ("--prompts-file PATH") begins every error. ValueError for a line over `max_bytes` bytes, text that
    is not UTF-8, a lone carriage return, or a file without a prompt."""
    offset, count = 0, 0  # bytes read before the current line; prompts so far
    for line_number in itertools.count(1):
        raw = file.readline(max_bytes + 1)
        if not raw:
            break
        if len(raw) > max_bytes and not raw.endswith(b"\n"):  # readline stopped at the cap, not at a line end
            raise ValueError(f"{name} line {line_number} is longer than {max_bytes:,} bytes, more than a prompt the "
                             "model's context can hold: one prompt per line")
        start = offset
        offset += len(raw)
        if line_number == 1 and raw.startswith(codecs.BOM_UTF8):  # a BOM is no text of the prompt
            raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name} is not UTF-8 text ({e.reason} at byte {start + e.start})") from None
        text = text.removesuffix("\n").removesuffix("\r")
        if not text.strip():
            continue
        if "\r" in text:
            raise ValueError(f"{name} line {line_number} holds a carriage return (\\r) that ends no line: lines end "
                             "with \\n or \\r\\n; convert old Mac line ends (\\r) to \\n")
        count += 1
        yield Prompt(count, f"{name} line {line_number}", text)
    if not count:
        raise ValueError(f"{name} holds no prompt ({'it is empty' if not offset else 'only blank lines'}): write one "
                         "prompt per line")


Encoded = tuple[Prompt, np.ndarray]  # a prompt and its int32 ids [1, P]


def encoded(prompts: Iterable[Prompt], encode: Callable[[Prompt], np.ndarray]) -> Iterator[Encoded | Exception]:
    """(prompt, encode(prompt)) of each prompt; a ValueError or OSError of reading or encoding one comes in
    its place (and ends the stream), so that the batches before it still run."""
    try:
        for prompt in prompts:
            yield prompt, encode(prompt)
    except (ValueError, OSError) as e:
        yield e


def prompt_batches(items: Iterable[Encoded | Exception], fits: Callable[[int, int], bool], *,
                   multiple: int = 1) -> Iterator[list[Encoded]]:
    """Batches of consecutive `encoded` items: each as many as `fits(rows, longest prompt)` allows (at least
    one; `fits` must not grow true with more rows or a longer prompt). A batch that is full by the rule
    keeps a multiple of `multiple` rows where it has more (the rest start the next); the last batch is what
    is left. An item is read only to fill a batch that has room for it, so a batch is returned before the
    next one's first item is read; an error item is raised when the batch it would join is formed (a full
    batch before it still runs; every error of a batch comes before it runs)."""
    items = iter(items)
    queue: collections.deque = collections.deque()  # read, not batched yet

    def head():
        if not queue and (item := next(items, None)) is not None:
            queue.append(item)
        return queue[0] if queue else None

    while (first := head()) is not None:
        if isinstance(first, Exception):
            raise first
        rows = [queue.popleft()]
        longest = rows[0][1].shape[1]
        while (room := fits(len(rows) + 1, longest)) and (nxt := head()) is not None:  # room for a row: read one
            if isinstance(nxt, Exception):
                raise nxt  # the batch it would join is not run
            if not fits(len(rows) + 1, max(longest, nxt[1].shape[1])):
                break
            rows.append(queue.popleft())
            longest = max(longest, nxt[1].shape[1])
        if (queue or not room) and len(rows) > multiple and len(rows) % multiple:  # full, and more may follow
            keep = len(rows) - len(rows) % multiple
            queue.extendleft(reversed(rows[keep:]))
            rows = rows[:keep]
        yield rows
