"""Continuous batching for the block-diffusion families (SDAR / TraDo, LLaDA2): a fixed number of slots that
requests enter and leave between block steps.

`generate` batches in lockstep: a row that has finished idles until the slowest row of its batch ends,
and a new prompt waits for the whole batch. The engine keeps `slots` rows on the device instead (a
static batch: one compiled step serves every mix of requests). `insert` prefills one request's prompt
into a free slot's rows of the slot-indexed KV cache; `step` runs a block's worth of forwards over every
busy slot, each slot at its own block and its own denoising step in its own row-local coordinates: a slot
whose block is unmasked commits it on its next forward (riding on the next block's first step, as in
`generate`) instead of waiting for the slowest slot (`dllm_jax.generate.block_loop.decode_forwards`; with
`schedule="block"` a step decodes one whole block per slot instead, as one row of batched `generate` does:
`decode_block`). Between steps the host scheduler (`Engine.step`) retires the slots that finished and admits
queued requests into them, so a short request leaves as soon as its last block is decoded and a new one
starts at the next step.

Each request draws its random numbers from its own seed (a PRNG key per slot) and its own counter, and
its prompt's K/V are its own (rows of a batched prefill do not mix), so a request's tokens are those `generate` returns for its prompt alone
with the same seed and options, whatever else shares the slots. A request sets its prompt, its
`max_new_tokens` (the family's answer length: SDAR's max_new_tokens, LLaDA2's gen_length), its seed, and its
own temperature, top-p and top-k (per-slot arrays of the step, `dllm_jax.generate.sampling.RowSampling`: it
gets what `generate` gives it with `options | {"temperature": t, "top_p": p, "top_k": k}`, temperature 0
meaning the family's greedy decoding: SDAR's top-k 1, LLaDA2's argmax). A request's top-k is at most the
engine's `max_top_k` (the compiled step selects that many candidates, when some slot asks for a top-k). The
confidence threshold and SDAR's remasking rule are inputs of the step too (a request's own, `submit(threshold=,
remasking=)`, else the engine's), so requests with different rules share a step; the other sampling options (SDAR:
denoising steps; LLaDA2: block length, steps) are the engine's, static in its compiled step.
What differs between the families (model functions, sampler, block length, request checks) is the family's
`SlotLoop` (`dllm_jax.families`: `Family.slots`).

Prompts are prefilled in a few static lengths (`prefill_buckets`: whole blocks, doubling up to the prefill
chunk, the chunk, the chunk and a block, then the slot width): a prompt takes the shortest bucket that holds it, and the
requests admitted at one step that share a bucket are prefilled together, in one program of 1, 2, 4, ... rows
(`Engine.admit`), so the inserts compile once per bucket and batch size. The width bucket prefills in chunks of `INSERT_CHUNK` positions and runs
only the chunks its prompt's complete blocks need (`dllm_jax.models.block_diffusion.prefill`), so a long prompt pays for
its own length, not for the next power of two (doubling buckets padded 512-2048-token prompts by a third).

With a prefix cache (`prefix_cache_bytes`, `dllm_jax.serve.prefix_cache`), an insert whose prompt starts with
complete blocks an earlier insert prefilled starts from that insert's one-row cache and prefills only the rest.

An attention method (MAGE, FlashBlock, FlashBlock + MAGE) keeps its per-layer state per slot in the step's
carry. A new request needs none of what the slot's previous request left there: its first forward (no commit
pending, the block's first step) re-estimates its row's selection and cached parts, as every block's first
step does in `generate` (tested: equal to `generate` alone with the method).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import validation as check
from dllm_jax.families import FAMILIES, family_of
from dllm_jax.generate.block_loop import trim
from dllm_jax.generate.requests import cache_dtype_of, check_context, make_options
from dllm_jax.generate.sampling import RowSampling, row_sampling
from dllm_jax.serve.prefix_cache import PrefixCache, shared_positions
from dllm_jax.serve.requests import Request, RequestQueue, SamplingValues
from dllm_jax.serve.slots import (INSERT_CHUNK, SCHEDULES, Slots, Snapshot, init_slots, insert_program, prefill_buckets,
                                  prefill_program, step_program, stop_table)


@dataclasses.dataclass
class Staged:
    """A long prompt being prefilled a chunk per step into a cache of its own, its slot held for it."""

    request: Request
    prompt: np.ndarray  # int32 [bucket]
    cache: Any  # a one-row KVCache
    done: int  # positions prefilled so far
    end: int  # the positions of its complete blocks


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A dispatched step: its snapshot and the request each slot held when it was dispatched."""

    snapshot: Snapshot
    running: tuple


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A step running on the engine's dispatch thread (`overlap`): its future (the state, its snapshot) and the
    request each slot held when it was dispatched."""

    future: concurrent.futures.Future
    running: tuple


@dataclasses.dataclass
class EngineTiming:
    """What an engine did and where its thread's time went, in host seconds by phase (counters it adds to;
    `benchmarks/serving.py` reports them): the device's own work shows in `wait_s`, the host's in the rest."""

    steps: int = 0
    busy_slot_steps: int = 0  # busy slots summed over the steps: / steps = the mean batch a step decoded
    inserts: int = 0  # requests admitted
    prefills: int = 0  # insert programs run (each prefills one or more of them)
    prefill_chunks: int = 0  # chunks of long prompts prefilled between steps
    admit_s: float = 0.0  # dispatching inserts (queued requests into free slots)
    dispatch_s: float = 0.0  # dispatching steps
    wait_s: float = 0.0  # blocked on a step's result while the device ran it (and the inserts before it)
    retire_s: float = 0.0  # reading a step's result, freeing the slots it finished
    progress_s: float = 0.0  # the running requests' tokens so far (`Engine.progress`)
    # forwards the steps ran against those the rows needed (by block, a step lasts until its slowest row's block
    # is unmasked)
    forwards: int = 0  # forwards the steps ran
    row_forwards: int = 0  # denoising forwards the decoding rows needed, summed over rows and steps
    row_blocks: int = 0  # blocks the rows finished, summed over steps


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: `tokens` are its prompt and generated tokens as `generate` returns them for
    the prompt alone (cut after the first stop token)."""

    request_id: int
    tokens: np.ndarray  # int32 [prompt + generated]
    prompt_length: int

    @property
    def generated(self) -> np.ndarray:
        return self.tokens[self.prompt_length:]


# the largest top-k a request may ask for unless the engine is told (vLLM and SGLang take any; a static bound keeps
# one compiled step, and the selection runs only in steps where some slot asks for a top-k)
DEFAULT_MAX_TOP_K = 64


class Engine(RequestQueue):
    """Continuous batching of requests to a block-diffusion model (SDAR / TraDo, LLaDA2) over `slots` device rows
    of up to `max_context` tokens each (prompt + new tokens). `submit` queues a request; `step` admits queued
    requests into free slots, advances every busy slot by one block and returns the requests that finished; `run`
    steps until nothing is left. `method`: None (dense), a method name or an attention policy, as `generate`'s.
    `options` are the family's generate options (`dllm_jax.generate`) but its answer length (SDAR's
    max_new_tokens, LLaDA2's gen_length), which is per request; their temperature, top-p and top-k are the
    defaults of a request that sets none. `max_top_k`: the largest top-k a request may ask for (the compiled
    step's static candidate count; None: DEFAULT_MAX_TOP_K, or the options' top-k if larger, at most the
    vocabulary). `overlap`: run each step on a dispatch thread of the engine's own and read the previous step's
    result meanwhile, so that the host's work (retiring, admitting, the progress the server streams) runs while
    the device decodes; a slot whose request finished then idles one step before the next request enters it. A
    thread, because the jitted step returns only when the device has finished it (XLA evaluates its while loops'
    conditions on the host; docs/serving.md), so dispatching ahead on the calling thread would not overlap. On by
    default: it serves more tokens/s under load (docs/serving.md has the figures).
    `prefill_chunk`: prompt positions per prefill chunk (a multiple of the block length): a prompt
    with more left to prefill is prefilled a chunk per step while the busy slots decode (`admit`). `schedule`: "forward" (the default: a step runs a block's worth of forwards and
    each slot moves to its next block as soon as its own is done, every forward a commit-and-step one) or "block"
    (every busy slot decodes one block per step; a step lasts until its slowest slot's block is unmasked). The same
    tokens either way; on one H200 (SDAR-8B, 16 slots, 128 requests at 16 req/s) "forward" served 2545 tokens/s
    against 1700 by block and 1273 in lockstep batches (docs/serving.md). `prefix_cache_bytes`: the device memory
    the prefix cache may hold (`dllm_jax.serve.prefix_cache`; 0, the default: no prefix cache). `prefill_batch`: the
    most requests of one prompt bucket prefilled in one program (None, the default: every slot; 1: one request per
    prefill). The engine reads the model's weights once, when it is built."""

    def __init__(self, model, *, slots: int = 8, max_context: int | None = None, method=None,
                 max_top_k: int | None = None, overlap: bool = True, prefill_chunk: int = INSERT_CHUNK,
                 schedule: str = "forward", prefix_cache_bytes: int = 0, prefill_batch: int | None = None,
                 **options):
        config = model.config
        family = family_of(config)
        if family.slots is None:
            served = ", ".join(f.label for f in FAMILIES.values() if f.slots is not None)
            raise ValueError(f"the slot engine runs the block-diffusion families ({served}); {family.label} is "
                             "served in lockstep batches (dllm_jax.serve.lockstep.LockstepEngine)")
        if family.answer_option in options:
            raise ValueError(f"{family.answer_option} is per request: pass max_new_tokens to submit")
        if model.mesh is not None:  # its slots, cache and inserts are not placed on a mesh (not built)
            raise ValueError("the slot engine runs a model on one device: load it without mesh= to serve it")
        super().__init__(config, slots=slots, max_context=max_context)
        # the weights as the jitted programs take them, read once: `model.params()` walks every layer's variables,
        # ~4 ms of host time on SDAR-8B that each step and each admission would otherwise pay
        self.params = model.params()
        self.loop = family.slots
        self.rules = family.remasking
        # the answer length stands at the longest a request can ask for (LLaDA2's steps per block depend on it:
        # a request that would change them is refused by the loop's check)
        options = make_options(family.options_class, family.label, options | {family.answer_option: self.max_context})
        self.defaults = SamplingValues(options.temperature, options.top_p, options.top_k)
        if max_top_k is None:
            max_top_k = min(max(DEFAULT_MAX_TOP_K, options.top_k), config.vocab_size)
        self.max_top_k = check.integer("max_top_k", max_top_k, minimum=0, maximum=config.vocab_size)
        if options.top_k > self.max_top_k:
            raise ValueError(f"top_k={options.top_k} (the default of a request) exceeds max_top_k={self.max_top_k}")
        # the slots' sampling values are the step's inputs (`RowSampling`): the step compiles for the options'
        # structure, whose top_k is the static bound of the slots' own (`sdar_commit`, LLaDA2's `commit`)
        defaults = options.sampling(1)
        self.threshold, self.remasking = float(defaults.threshold[0]), int(defaults.remasking[0])
        self.options = dataclasses.replace(options.structure(config.vocab_size), top_k=self.max_top_k)
        self.policy = family.policy(method)
        bl = self.block_length = self.loop.block_length(config, self.options)
        self.width = -(-self.max_context // bl) * bl
        self.loop.check_request(config, np.zeros((1, 0), np.int32), self.max_context, self.options)
        self.prefill_chunk = check.integer("prefill_chunk", prefill_chunk, minimum=bl)
        if self.prefill_chunk % bl:
            raise ValueError(f"prefill_chunk={prefill_chunk} is not a multiple of the block length {bl}")
        self.buckets = prefill_buckets(bl, self.width, self.prefill_chunk)
        self.prefill_batch = check.integer("prefill_batch", self.slots if prefill_batch is None else prefill_batch,
                                           minimum=1)
        self.state = init_slots(self.params, config=config, slots=self.slots, width=self.width, policy=self.policy,
                                loop=self.loop, block_length=bl,
                                cache_dtype=cache_dtype_of(options.kv_cache_dtype, self.policy,
                                                           self.params["embed"].dtype))
        self.prefix = PrefixCache(prefix_cache_bytes, bl)
        self.staged: dict[int, Staged] = {}  # slot -> the long prompt prefilled into it a chunk per step
        self.running: list[Request | None] = [None] * self.slots
        self.overlap = check.flag("overlap", overlap)
        self.schedule = check.choice("schedule", schedule, SCHEDULES)
        self.dispatched: Dispatched | None = None  # a step on the dispatch thread (overlap): self.state is stale
        self.busy_changed = False  # slots were freed while a step was dispatched: its successor's flags to update
        self.dispatcher = concurrent.futures.ThreadPoolExecutor(1, "dllm-jax-step") if self.overlap else None
        self.seen: InFlight | None = None  # the last step read: what `progress` reports
        self.timing = EngineTiming()

    def memory_plan(self) -> dict:
        """Bytes on the device: the weights, the slots' KV cache, the rest of the slots' state, the prefix cache's
        budget, the cache of the one long prompt staged at a time (a row as wide as a slot's), the most an insert
        prefills at once (`prefill_batch` rows of the bucket past the chunk; of a slot's width where the prefix cache
        keeps them), and the device's memory and what is left of it after all six (None where the device does not say:
        `jax.Device.memory_stats`)."""
        kv = sum(leaf.nbytes for leaf in jax.tree.leaves(self.state.carry.cache))
        row = kv // self.slots
        # an inserted prompt's complete blocks fit a chunk: at most the bucket of a chunk and a block (the last but the
        # width); kept rows are a slot wide
        insert_width = self.buckets[-2] if len(self.buckets) > 1 and not self.prefix.max_bytes else self.width
        plan = dict(weights=sum(leaf.nbytes for leaf in jax.tree.leaves(self.params)), kv_cache=kv,
                    slot_state=sum(leaf.nbytes for leaf in jax.tree.leaves(self.state)) - kv,
                    prefix_cache=self.prefix.max_bytes, staged_prompt=row,
                    insert=self.prefill_batch * row * insert_width // self.width)
        limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        return plan | dict(device=limit, headroom=None if limit is None else limit - sum(plan.values()))

    def check(self, prompt_ids, max_new_tokens: int, seed: int = 0, temperature: float | None = None,
              top_p: float | None = None, top_k: int | None = None, *,
              threshold: float | None = None, remasking: str | None = None,
              stop_ids=None, factor: float | None = None) -> tuple[np.ndarray, int, int, SamplingValues]:
        """(int32 prompt, max_new_tokens, seed, sampling) of a request the engine can take (None: the options'
        temperature, top-p, top-k, threshold and remasking; no stop ids besides the model's), or a ValueError
        naming the problem. Reads only the engine's settings:
        callable from any thread."""
        prompt, max_new_tokens, seed = self.checked_prompt(prompt_ids, max_new_tokens, seed)
        if factor is not None:
            raise ValueError(f"factor={factor}: Fast-dLLM's factor rule is LLaDA's; this server's "
                             f"{family_of(self.config).label} model commits by its remasking rule and threshold")
        sampling = self.checked_sampling(temperature, top_p, top_k, self.defaults, max_top_k=self.max_top_k,
                                         threshold=threshold, remasking=remasking, rules=self.rules,
                                         stop_ids=stop_ids)
        check_context(self.config, len(prompt), max_new_tokens)
        if len(prompt) + max_new_tokens > self.max_context:
            raise ValueError(f"the prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens = "
                             f"{len(prompt) + max_new_tokens} exceeds the engine's max_context={self.max_context}")
        self.loop.check_request(self.config, prompt[None], max_new_tokens, self.options)
        return prompt, max_new_tokens, seed, sampling

    @property
    def busy(self) -> int:
        return sum(r is not None for r in self.running)

    def room(self, prompt_length: int) -> int:
        """The most new tokens a request with a prompt of this length may ask for."""
        return max(self.max_context - prompt_length, 1)

    def cancel(self, request_id: int) -> bool:
        """Drops a queued or running request (its slot is free for the next step); False if it is neither."""
        if super().cancel(request_id):
            return True
        for slot, staged in self.staged.items():
            if staged.request.request_id == request_id:
                del self.staged[slot]
                return True
        for slot, request in enumerate(self.running):
            if request is not None and request.request_id == request_id:
                self.running[slot] = None
                self.mark_busy()
                return True
        return False

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight."""
        return not (self.queue or self.busy or self.staged or self.dispatched is not None)

    def mark_busy(self) -> None:
        """The device's busy flags from the host's slots, after requests left them (once the step in flight, if
        any, has returned: `settle`)."""
        if self.dispatched is not None:
            self.busy_changed = True
            return
        self.state = self.state.replace(busy=jnp.asarray([r is not None for r in self.running]))

    def settle(self) -> InFlight | None:
        """Waits for the step on the dispatch thread, if any: its state becomes the engine's; returns it to read."""
        if self.dispatched is None:
            return None
        start = time.perf_counter()
        self.state, snapshot = self.dispatched.future.result()
        self.timing.wait_s += time.perf_counter() - start
        settled = InFlight(snapshot, self.dispatched.running)
        self.dispatched = None
        if self.busy_changed:
            self.busy_changed = False
            self.mark_busy()
        return settled

    def dispatch(self, state: Slots) -> tuple[Slots, Snapshot]:
        """One jitted step of `state` (donated)."""
        return step_program(self.params, state, config=self.config, options=self.options, policy=self.policy,
                         loop=self.loop, block_length=self.block_length, schedule=self.schedule)

    def progress(self) -> dict[int, np.ndarray]:
        """{request id: the tokens it has generated so far} for every running request, as of the last step read:
        its decoded blocks (final: a decoded block never changes), cut after a stop token, as its Completion will
        hold them."""
        if self.seen is None:
            return {}
        running = self.still_running(self.seen)
        if not running:
            return {}
        start = time.perf_counter()
        x, decoded = self.seen.snapshot.x, self.seen.snapshot.decoded  # host arrays (`retire`)
        tokens = {r.request_id: self.answer(x, decoded, slot, r)[len(r.prompt_ids):] for slot, r in running}
        self.timing.progress_s += time.perf_counter() - start
        return tokens

    def still_running(self, step: InFlight) -> list[tuple[int, Request]]:
        """(slot, request) of the requests a step decoded that still hold their slot (not retired, cancelled)."""
        return [(slot, r) for slot, r in enumerate(step.running) if r is not None and self.running[slot] is r]

    def answer(self, x: np.ndarray, decoded: np.ndarray, slot: int, request: Request) -> np.ndarray:
        """The slot's prompt and decoded tokens as `generate` returns them for the prompt alone: cut after the
        first stop token, and at max_new_tokens where the family's generate cuts there (LLaDA2)."""
        n = len(request.prompt_ids)
        (tokens,) = trim(x[slot:slot + 1], decoded[slot:slot + 1], [n], self.stop_ids(request.sampling.stop_ids))
        return np.asarray(tokens[:n + request.max_new_tokens] if self.loop.cuts_answer else tokens)

    def admit(self) -> None:
        """Queued requests into free slots, in arrival order: one that starts with complete blocks the prefix cache
        holds is prefilled alone from its entry; the others are prefilled together, those of one prompt bucket in
        one program (batches of 1, 2, 4, ... rows, a short batch padded by repeating a row). A request that starts
        with complete blocks of one admitted before it in the same call waits for that one's prefill, so that it
        finds them in the prefix cache. A prompt with more than `prefill_chunk` positions left to prefill holds its
        slot and is prefilled a chunk per call (chunked prefill: the busy slots decode between its chunks), then
        takes the slot. One such prompt is staged at a time (its cache is a row as wide as a slot's): a later one
        keeps its place at the head of the queue while the shorter ones behind it are admitted."""
        start = time.perf_counter()
        self.advance_staged()
        pending: dict[int, list] = {}  # prompt bucket -> [(slot, request)], to prefill together
        deferred = []  # long prompts waiting for the staged one
        for slot in [slot for slot, running in enumerate(self.running) if running is None and slot not in self.staged]:
            request = self.next_admissible(deferred)
            if request is None:
                break
            blocks = self.complete_blocks(request)
            entry, begin = None, 0
            if self.prefix.max_bytes and len(blocks):
                if any(shared_positions(blocks, self.complete_blocks(other), self.block_length)
                       for group in pending.values() for _, other in group):
                    self.prefill(pending)
                entry, begin = self.prefix.lookup(blocks)
            if len(blocks) - begin > self.prefill_chunk:  # longer than a chunk: a chunk per step, the others decoding
                prompt = self.padded_prompt(request, self.bucket(request))
                cache = entry.cache if entry is not None else self.loop.init_cache(
                    self.config, 1, self.state.carry.cache.max_length, self.state.carry.cache.k[0].dtype)
                self.staged[slot] = Staged(request, prompt, cache, begin, len(blocks))
                continue
            self.running[slot] = request
            if entry is not None:
                self.insert([(slot, request)], entry.cache, begin)
                continue
            pending.setdefault(self.bucket(request), []).append((slot, request))
        self.prefill(pending)
        self.queue.extendleft(reversed(deferred))
        self.timing.admit_s += time.perf_counter() - start

    def next_admissible(self, deferred: list) -> Request | None:
        """The next queued request, or None: while a long prompt is staged, later long ones (more than a chunk of
        complete blocks; a prefix-cache hit may shorten one, found at its turn) go to `deferred`, in order."""
        while self.queue:
            request = self.queue.popleft()
            if self.staged and len(self.complete_blocks(request)) > self.prefill_chunk:
                deferred.append(request)
                continue
            return request
        return None

    def advance_staged(self) -> None:
        """One prefill chunk of each long prompt in `staged`; one whose prefill is complete takes its slot."""
        for slot, staged in list(self.staged.items()):
            end = min(staged.done + self.prefill_chunk, staged.end)
            staged.cache = prefill_program(self.params, staged.prompt[None], staged.cache, np.asarray([end], np.int32),
                                           np.int32(staged.done), config=self.config, loop=self.loop,
                                           block_length=self.block_length, chunk=self.prefill_chunk)
            staged.done = end
            self.timing.prefill_chunks += 1
            if end == staged.end:
                del self.staged[slot]
                self.running[slot] = staged.request
                self.insert([(slot, staged.request)], staged.cache, end)
                if self.prefix.max_bytes:
                    self.prefix.add(self.complete_blocks(staged.request), staged.cache)

    def complete_blocks(self, request: Request) -> np.ndarray:
        """The request's complete prompt blocks: what its insert prefills (and the prefix cache may hold)."""
        n = len(request.prompt_ids)
        return request.prompt_ids[:n - n % self.block_length]

    @staticmethod
    def padded_prompt(request: Request, width: int) -> np.ndarray:
        """int32 [width]: the request's prompt, then zeros (past its complete blocks: scratch)."""
        prompt = np.zeros(width, np.int32)
        prompt[:len(request.prompt_ids)] = request.prompt_ids
        return prompt

    def bucket(self, request: Request) -> int:
        """The static prompt width its insert prefills: the shortest bucket holding the prompt."""
        return next(b for b in self.buckets if b >= len(request.prompt_ids))

    def prefill(self, pending: dict[int, list]) -> None:
        """Inserts each bucket's requests of `pending` in programs of up to `prefill_batch` of them (a power-of-two
        batch each) and empties it."""
        for group in pending.values():
            for first in range(0, len(group), self.prefill_batch):
                members = group[first:first + self.prefill_batch]
                rows = 1 << (len(members) - 1).bit_length()
                self.insert(members + [members[0]] * (rows - len(members)), None, 0, real=len(members))
        pending.clear()

    def insert(self, members: list, base, begin: int, real: int | None = None) -> None:
        """Prefills `members` ([(slot, request)], one prompt bucket; the first `real` of them distinct, the rest
        repeating the first) into their slots from `base` (a one-row prefix-cache entry, or None) at `begin`, and
        keeps each request's complete blocks in the prefix cache."""
        real = len(members) if real is None else real
        requests = [request for _, request in members]
        width = max(self.bucket(request) for request in requests)
        prompts = np.stack([self.padded_prompt(request, width) for request in requests])
        values = jax.tree.map(lambda *v: np.stack(v), *(self.row_values(r.sampling) for r in requests))
        self.state, cache = insert_program(
            self.params, self.state, np.asarray([slot for slot, _ in members], np.int32), prompts,
            np.asarray([len(r.prompt_ids) for r in requests], np.int32),
            np.asarray([r.max_new_tokens for r in requests], np.int32), np.asarray([r.seed for r in requests], np.int32),
            values, np.stack([stop_table(self.config, r.sampling.stop_ids) for r in requests]), base, np.int32(begin),
            config=self.config, loop=self.loop, block_length=self.block_length, chunk=self.prefill_chunk,
            keep=bool(self.prefix.max_bytes))
        self.timing.inserts += real
        self.timing.prefills += 1
        if self.prefix.max_bytes:
            for row, request in enumerate(requests[:real]):
                blocks = self.complete_blocks(request)
                if begin < len(blocks):
                    self.prefix.add(blocks, jax.tree.map(lambda a: a[row:row + 1], cache))

    def row_values(self, sampling: SamplingValues) -> RowSampling:
        """A request's sampling as its slot's row of the step's `RowSampling` (the engine's threshold and remasking
        where it sets none)."""
        threshold = self.threshold if sampling.threshold is None else sampling.threshold
        remasking = self.remasking if sampling.remasking is None else self.rules.index(sampling.remasking)
        row = row_sampling(1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           threshold=threshold, remasking=remasking)
        return jax.tree.map(lambda value: value[0], row)

    def step(self) -> list[Completion]:
        """Admits queued requests, decodes one block in every busy slot, retires the finished ones (with
        `overlap`, those the previous step finished, read while this one runs on the dispatch thread)."""
        previous = self.settle()  # overlap: the step dispatched last time, retired below while the next one runs
        self.admit()
        if self.busy:
            start = time.perf_counter()
            running = tuple(self.running)
            if self.overlap:
                self.dispatched = Dispatched(self.dispatcher.submit(self.dispatch, self.state), running)
            else:
                self.state, snapshot = self.dispatch(self.state)
                previous = InFlight(snapshot, running)
            self.timing.steps += 1
            self.timing.busy_slot_steps += self.busy
            self.timing.dispatch_s += time.perf_counter() - start
        return [] if previous is None else self.retire(previous)

    def retire(self, step: InFlight) -> list[Completion]:
        """Reads a dispatched step's snapshot (waiting for it) and frees the slots whose request it finished."""
        start = time.perf_counter()
        # every field in one transfer (reading them one by one cost ~0.7 ms each on an H100); `progress` and
        # `finished` read the host copy
        step = InFlight(jax.device_get(step.snapshot), step.running)
        ready = time.perf_counter()
        self.seen = step
        self.timing.wait_s += ready - start
        s = step.snapshot
        self.timing.forwards += int(s.ran)
        self.timing.row_forwards += int(s.forwards.sum())
        self.timing.row_blocks += int(s.blocks.sum())
        try:
            return self.finished(step)
        finally:
            self.timing.retire_s += time.perf_counter() - ready

    def finished(self, step: InFlight) -> list[Completion]:
        """The completions of the requests a step (read) finished; their slots are freed."""
        s = step.snapshot  # host arrays (`retire`)
        done = [(slot, r) for slot, r in self.still_running(step) if s.block[slot] >= s.last[slot] or s.stopped[slot]]
        if not done:
            return []
        completions = []
        for slot, request in done:
            completions.append(Completion(request.request_id, self.answer(s.x, s.decoded, slot, request),
                                          len(request.prompt_ids)))
            self.running[slot] = None
        self.mark_busy()
        return completions

    def run(self) -> dict[int, Completion]:
        """Steps until the queue and the slots are empty; {request id: Completion}."""
        done = {}
        while not self.idle:
            done.update((c.request_id, c) for c in self.step())
        return done
