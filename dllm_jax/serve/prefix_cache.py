"""The slot engine's prefix cache: the K/V of requests' complete prompt blocks, kept after their insert, so that a
later request whose prompt starts with the same blocks prefills only the rest (chat and agent traffic repeats long
system prompts and few-shot prefixes).

An entry is one insert's one-row KV cache (the slot cache's shape, whatever the prompt's length: every insert
compiles one program) and the prompt tokens whose K/V it holds, whole blocks. A lookup takes the entry sharing
the most whole blocks with the new prompt's complete blocks, compared token by token (exact, no hash to collide);
the insert then starts from that entry's cache and prefills from the first block that differs
(`dllm_jax.models.block_diffusion.prefill`'s `begin`). Block diffusion makes this exact: a position's K/V depend
only on the positions before its block's end (the block-causal mask), so a shared block prefix has the same K/V
in every prompt. Entries are dropped least recently used first past `max_bytes`; one entry whose tokens start
another's is superseded by the longer one. The lookup scans the entries (a budget holds tens of them at 8B
shapes: an entry of a 4k-position slot is ~0.6 GB).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from dllm_jax import validation as check


def shared_positions(a: np.ndarray, b: np.ndarray, block_length: int) -> int:
    """Positions of the whole blocks that token sequences `a` and `b` both begin with."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    common = n if differ.size == 0 else int(differ[0])
    return common - common % block_length


@dataclasses.dataclass(frozen=True)
class Entry:
    tokens: np.ndarray  # int32 [n]: the complete prompt blocks whose K/V `cache` holds at positions 0..n-1
    cache: Any  # a one-row KVCache of the slot cache's capacity
    nbytes: int


class PrefixCache:
    """Complete prompt blocks' K/V, least recently used dropped past `max_bytes` (module docstring). `hit_tokens` /
    `query_tokens` count the prompt positions found cached / looked up."""

    def __init__(self, max_bytes: int, block_length: int):
        self.max_bytes = check.integer("prefix_cache_bytes", max_bytes, minimum=0)
        self.block_length = block_length
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # least recent first
        self.next_key = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    def clear(self) -> None:
        """No entries, the counters at 0."""
        self.entries.clear()
        self.hit_tokens = self.query_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def shared(self, entry: Entry, tokens: np.ndarray) -> int:
        """Positions of whole blocks `tokens` begins with that `entry` holds."""
        return shared_positions(entry.tokens, tokens, self.block_length)

    def lookup(self, tokens: np.ndarray) -> tuple[Entry | None, int]:
        """(the entry sharing the most whole blocks with `tokens`, a prompt's complete blocks, and that many
        positions), or (None, 0); the entry becomes the most recently used."""
        best, found = None, 0
        for key, entry in self.entries.items():
            common = self.shared(entry, tokens)
            if common > found:
                best, found = key, common
        if best is not None:
            self.entries.move_to_end(best)
        self.query_tokens += len(tokens)
        self.hit_tokens += found
        return (None if best is None else self.entries[best]), found

    def add(self, tokens: np.ndarray, cache) -> None:
        """Keeps `cache` (one insert's one-row KV cache) for the complete blocks `tokens`, unless it alone exceeds
        the budget; entries whose tokens it starts with (now held twice) go, then the least recent ones past it."""
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
        if not len(tokens) or nbytes > self.max_bytes:
            return
        tokens = np.asarray(tokens, np.int32).copy()
        for key in [k for k, e in self.entries.items() if self.shared(e, tokens) == len(e.tokens)]:
            del self.entries[key]
        while self.entries and self.nbytes + nbytes > self.max_bytes:
            self.entries.popitem(last=False)
        self.entries[self.next_key] = Entry(tokens, cache, nbytes)
        self.next_key += 1
