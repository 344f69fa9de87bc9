"""Lockstep serving for the families the slot engine does not run (LLaDA, Dream, DiffusionGemma): queued
requests are generated together, up to `slots` at a time, by one `dllm_jax.generate` call, with the same
interface as `Engine` so the HTTP server and its worker take either.

LLaDA and Dream denoise their whole answer region at every step (DiffusionGemma its canvases after the prompt),
so a request's answer depends on that region's length: the server fixes it (the family's answer option, e.g.
`gen_length`) with the rest of the sampling options, and a request's `max_new_tokens` only cuts the answer. Greedy requests (temperature 0, the
families' default, and no random remasking) are generated together, a batch's rows each getting what `generate` gives their prompt alone
(LLaDA's left-padded rows hide their pad keys, `padding="mask"`; a family that takes no padding, LLaDA2 if served
this way, gets batches of one prompt length, the others waiting for the next). A request may sample with its own
temperature (Dream: and top-p, top-k) and seed: a batch draws its noise from one seed over all its rows, so a
sampled request is generated alone, with its own values and seed, and gets what `generate` gives it. A LLaDA
request may also choose its remasking rule and, where the server decodes with Fast-dLLM's confidence threshold,
its own threshold: greedy requests that agree on them are batched together. These values are inputs of the
compiled loop (dllm_jax.generate.sampling.RowSampling), so a new one compiles nothing. A family whose generate
has no temperature option samples every request (DiffusionGemma: canvases of random tokens, its own temperature
schedule); its rows draw from seeds of their own (`Family.row_seeds`), so its requests are batched, each row what
`generate` gives the request alone with its seed. A request's answer arrives when its batch ends: no
block-by-block progress, and a new request waits for the running batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dllm_jax.families import family_of
from dllm_jax.generate import generate
from dllm_jax.generate.requests import make_options, until_stop
from dllm_jax.serve.engine import Completion
from dllm_jax.serve.requests import RequestQueue, SamplingValues
from dllm_jax.tokenizer import left_pad

# the samplers (`Family.sampler`) whose batches may mix prompt lengths, and the options that hide the padding
PADDED = {"LLaDA": dict(padding="mask"), "Dream": {}, "DiffusionGemma": {}}


class LockstepEngine(RequestQueue):
    """`Engine`'s interface over lockstep `generate` batches of up to `slots` requests (module docstring).
    `options`: the family's generate options, its answer option included (the answer every request decodes)."""

    def __init__(self, model, *, slots: int = 8, max_context: int | None = None, method=None, **options):
        super().__init__(model.config, slots=slots, max_context=max_context)
        self.model = model
        self.family = family_of(self.config)
        self.method = self.family.policy(method)
        self.options = dict(options)
        checked = self.checked = make_options(self.family.options_class, self.family.label, self.options)
        self.answer = getattr(checked, self.family.answer_option)
        # the sampling values a request may set: those its family's generate takes (LLaDA: temperature)
        self.sampled = tuple(f.name for f in dataclasses.fields(checked) if f.name in ("temperature", "top_p", "top_k"))
        self.defaults = SamplingValues(**{name: getattr(checked, name) for name in self.sampled})
        self.family.prepare(model, np.full((1, 1), 3, np.int32), None, self.method, self.options)  # options checked
        self.busy = 0

    def check(self, prompt_ids, max_new_tokens: int, seed: int = 0, temperature: float | None = None,
              top_p: float | None = None, top_k: int | None = None, *,
              threshold: float | None = None, remasking: str | None = None,
              stop_ids=None, factor: float | None = None) -> tuple[np.ndarray, int, int, SamplingValues]:
        """(int32 prompt, max_new_tokens, seed, sampling) of a request this server can take, or a ValueError
        naming the problem (any thread). A request sets only the sampling values its family's generate takes
        (LLaDA: temperature, remasking, and Fast-dLLM's threshold or factor where the server decodes with that rule;
        Dream: temperature, top_p, top_k) and its own stop token ids; None takes the server's."""
        prompt, max_new_tokens, seed = self.checked_prompt(prompt_ids, max_new_tokens, seed)
        for name, value, rule in (("threshold", threshold, "a confidence threshold"),
                                  ("factor", factor, "Fast-dLLM's factor rule")):
            if value is not None and getattr(self.checked, name, None) is None:
                raise ValueError(f"{name}={value}: this server ({self.family.label}) decodes without {rule} (a "
                                 f"server started with the option {name}= takes a request's own)")
        sampling = self.checked_sampling(temperature, top_p, top_k, self.defaults, threshold=threshold,
                                         remasking=remasking, rules=self.family.remasking, stop_ids=stop_ids,
                                         factor=factor)
        other = {name: getattr(sampling, name) for name in ("temperature", "top_p", "top_k")
                 if name not in self.sampled and getattr(sampling, name) != getattr(SamplingValues(), name)}
        if other:
            takes = (f"samples with {', '.join(self.sampled)} only" if self.sampled else
                     "takes no sampling values from a request (its sampler's schedule is the server's options)")
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in other.items())}: {self.family.label} {takes} (its "
                             "generate has no such option)")
        if max_new_tokens > self.answer:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the {self.answer} tokens this server decodes "
                             f"per answer ({self.family.answer_option}, fixed by the server: the family denoises "
                             "its whole answer region, so its length is part of the answer)")
        if len(prompt) + self.answer > self.max_context:
            raise ValueError(f"the prompt ({len(prompt)} tokens) + the {self.answer}-token answer region exceeds the "
                             f"server's max_context={self.max_context}")
        self.family.prepare(self.model, prompt[None], None, self.method, self.options | self.values(sampling))
        return prompt, max_new_tokens, seed, sampling

    def values(self, sampling: SamplingValues) -> dict:
        """The generate options a request's sampling sets."""
        values = {name: getattr(sampling, name) for name in self.sampled}
        for name in ("remasking", "threshold", "factor"):
            if getattr(sampling, name) is not None:
                values[name] = getattr(sampling, name)
        return values

    def room(self, prompt_length: int) -> int:
        """The most new tokens a request may ask for: the answer region's length."""
        return self.answer

    def progress(self) -> dict[int, np.ndarray]:
        return {}  # answers arrive whole, when their batch ends

    def greedy(self, request) -> bool:
        """Whether the request draws no random numbers (temperature 0, and no random remasking): its seed is moot.
        Never for a family without a temperature option (its sampler always draws)."""
        remasking = request.sampling.remasking or getattr(self.checked, "remasking", None)
        return "temperature" in self.sampled and request.sampling.temperature == 0 and remasking != "random"

    def step(self) -> list[Completion]:
        """Generates the next batch: up to `slots` queued greedy requests in arrival order (of the first one's
        prompt length where the family takes no padding), or where the first one samples, that request alone, or
        for a family whose rows draw from seeds of their own (`Family.row_seeds`) up to `slots` sampled requests
        with the same values, each with its seed."""
        if not self.queue:
            return []
        first = self.queue[0]
        padded = self.family.sampler in PADDED
        greedy = self.greedy(first)
        if greedy or self.family.row_seeds:
            batch = [r for r in self.queue if self.greedy(r) == greedy and self.values(r.sampling) ==
                     self.values(first.sampling) and (padded or len(r.prompt_ids) == len(first.prompt_ids))]
            batch = batch[:self.slots]
        else:
            batch = [first]
        for request in batch:
            self.queue.remove(request)
        ids, mask = left_pad([r.prompt_ids for r in batch], self.config.pad_token_id)
        options = self.options | self.values(first.sampling) | (PADDED[self.family.sampler] if padded and not mask.all()
                                                                else {})
        self.busy = len(batch)
        try:
            if greedy or not self.family.row_seeds:
                out = generate(self.model, ids, attention_mask=None if mask.all() else mask, method=self.method,
                               seed=0 if greedy else first.seed, **options)
            else:  # the family's own entry: `generate` takes one seed
                out = self.family.run(self.model, ids, None if mask.all() else mask, [r.seed for r in batch],
                                      self.method, False, False, options)
            out = np.asarray(out)
        finally:
            self.busy = 0
        completions = []
        for row, request in zip(out, batch):
            new = until_stop(row[ids.shape[1]:][:request.max_new_tokens], self.stop_ids(request.sampling.stop_ids))
            completions.append(Completion(request.request_id, np.concatenate([request.prompt_ids, new]),
                                          len(request.prompt_ids)))
        return completions
