"""Lockstep serving for the families the slot engine does not run (LLaDA, Dream): queued requests
are generated together, up to `slots` at a time, by one `dllm_jax.generate` call, with the same interface
as `Engine` so the HTTP server and its worker take either.

LLaDA and Dream denoise their whole answer region at every step, so a request's answer depends on that
region's length: the server fixes it (the family's answer option, e.g. `gen_length`) with the rest of the
sampling options, and a request's `max_new_tokens` only cuts the answer. Decoding is greedy (the families'
default temperature 0; a request asking for another temperature or top-p is refused): a batch's rows each
get what `generate` gives their prompt alone (LLaDA's left-padded rows hide their pad keys, `padding="mask"`;
a family that takes no padding, LLaDA2 if served this way, gets batches of one prompt length, the others
waiting for the next). A request's answer arrives when its batch ends: no block-by-block progress, and a new
request waits for the running batch.
"""

from __future__ import annotations

import numpy as np

from dllm_jax.families import family_of
from dllm_jax.generate import generate
from dllm_jax.generate.requests import until_stop
from dllm_jax.serve.engine import Completion
from dllm_jax.serve.requests import RequestQueue, SamplingValues
from dllm_jax.tokenizer import left_pad

PADDED = {"llada": dict(padding="mask"), "dream": {}}  # families whose batches may mix prompt lengths


class LockstepEngine(RequestQueue):
    """`Engine`'s interface over lockstep `generate` batches of up to `slots` requests (module docstring).
    `options`: the family's generate options, its answer option included (the answer every request decodes)."""

    def __init__(self, model, *, slots: int = 8, max_context: int | None = None, method=None, **options):
        super().__init__(model.config, slots=slots, max_context=max_context)
        self.model = model
        self.family = family_of(self.config)
        if options.get("temperature", 0) != 0:
            raise ValueError(f"lockstep serving of {type(model).__name__} is greedy (temperature 0): a batch draws "
                             "from one seed, so sampled requests would not get what they get alone")
        self.method = self.family.policy(method)
        self.options = dict(options)
        self.answer = getattr(self.family.options_class(**self.options), self.family.answer_option)
        self.family.prepare(model, np.full((1, 1), 3, np.int32), None, self.method, self.options)  # options checked
        self.busy = 0

    def check(self, prompt_ids, max_new_tokens: int, seed: int = 0, temperature: float | None = None,
              top_p: float | None = None, top_k: int | None = None) -> tuple[np.ndarray, int, int, SamplingValues]:
        """(int32 prompt, max_new_tokens, seed, sampling) of a request this server can take, or a ValueError
        naming the problem (any thread). Decoding is greedy: a request may ask for temperature 0, top_p 1 and
        top_k 0 only."""
        prompt, max_new_tokens, seed = self.checked_prompt(prompt_ids, max_new_tokens, seed)
        sampling = self.checked_sampling(temperature, top_p, top_k, SamplingValues())
        if sampling != SamplingValues():
            temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
            raise ValueError(f"{temperature=}, {top_p=}, {top_k=}: lockstep serving of {self.family.label} is "
                             "greedy (a batch draws from one seed, so a sampled request would not get what it gets "
                             "alone); ask for temperature 0")
        if max_new_tokens > self.answer:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the {self.answer} tokens this server decodes "
                             f"per answer ({self.family.answer_option}, fixed by the server: the family denoises "
                             "its whole answer region, so its length is part of the answer)")
        if len(prompt) + self.answer > self.max_context:
            raise ValueError(f"the prompt ({len(prompt)} tokens) + the {self.answer}-token answer region exceeds the "
                             f"server's max_context={self.max_context}")
        self.family.prepare(self.model, prompt[None], None, self.method, self.options)
        return prompt, max_new_tokens, seed, sampling

    def room(self, prompt_length: int) -> int:
        """The most new tokens a request may ask for: the answer region's length."""
        return self.answer

    def progress(self) -> dict[int, np.ndarray]:
        return {}  # answers arrive whole, when their batch ends

    def step(self) -> list[Completion]:
        """Generates the next batch: up to `slots` queued requests in arrival order (of the first one's prompt
        length where the family takes no padding)."""
        if not self.queue:
            return []
        first = self.queue[0]
        padded = self.family.name in PADDED
        batch = [r for r in self.queue if padded or len(r.prompt_ids) == len(first.prompt_ids)][:self.slots]
        for request in batch:
            self.queue.remove(request)
        ids, mask = left_pad([r.prompt_ids for r in batch], self.config.pad_token_id)
        options = self.options | (PADDED[self.family.name] if padded and not mask.all() else {})
        self.busy = len(batch)
        try:
            out = np.asarray(generate(self.model, ids, attention_mask=None if mask.all() else mask, method=self.method,
                                      **options))
        finally:
            self.busy = 0
        completions = []
        for row, request in zip(out, batch):
            new = until_stop(row[ids.shape[1]:][:request.max_new_tokens], self.config.stop_ids)
            completions.append(Completion(request.request_id, np.concatenate([request.prompt_ids, new]),
                                          len(request.prompt_ids)))
        return completions
