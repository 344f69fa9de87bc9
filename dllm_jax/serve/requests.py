"""What both serving engines share (`Engine`, slots; `LockstepEngine`, lockstep batches): their settings, the
queue of checked requests, and the checks of one request's prompt and answer length."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from dllm_jax import validation as check
from dllm_jax.generate.requests import check_prompt


# the most stop token ids a request may set (the slot engine keeps a static table of them per slot)
MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True)
class SamplingValues:
    """A request's sampling (checked; each given value or the engine's default)."""

    temperature: float = 0.0  # 0: the family's greedy decoding
    top_p: float = 1.0  # 1: no nucleus filter
    top_k: int = 0  # 0: no top-k filter
    threshold: float | None = None  # the confidence threshold of the family's remasking; None: the engine's
    remasking: str | None = None  # the family's remasking rule; None: the engine's
    stop_ids: tuple[int, ...] = ()  # token ids that end the answer, besides the model's own stop ids
    factor: float | None = None  # Fast-dLLM's factor rule (LLaDA); None: the engine's


@dataclasses.dataclass(frozen=True, eq=False)  # identity: two requests are never "equal" by their arrays
class Request:
    request_id: int
    prompt_ids: np.ndarray  # int32 [P]
    max_new_tokens: int
    seed: int
    sampling: SamplingValues


class RequestQueue:
    """`slots` and `max_context` checked against the model's config, and the queue: `submit` checks a request
    (the subclass's `check`) and queues it; `cancel` drops a queued one (subclasses also drop running ones)."""

    def __init__(self, config, *, slots: int, max_context: int | None):
        self.config = config
        self.slots = check.integer("slots", slots, minimum=1)
        limit = config.max_position_embeddings
        self.max_context = limit if max_context is None else check.integer("max_context", max_context, minimum=1)
        if self.max_context > limit:
            raise ValueError(f"max_context={self.max_context} exceeds the model's context of {limit} positions "
                             "(config max_position_embeddings)")
        self.queue: collections.deque[Request] = collections.deque()
        self.next_id = 0

    def check(self, prompt_ids, max_new_tokens: int, seed: int = 0, temperature: float | None = None,
              top_p: float | None = None, top_k: int | None = None, *,
              threshold: float | None = None, remasking: str | None = None,
              stop_ids=None, factor: float | None = None) -> tuple[np.ndarray, int, int, SamplingValues]:
        raise NotImplementedError

    def checked_sampling(self, temperature, top_p, top_k, defaults: SamplingValues, *,
                         max_top_k: int | None = None, threshold: float | None = None, remasking: str | None = None,
                         rules: tuple[str, ...] = (), stop_ids=None, factor: float | None = None) -> SamplingValues:
        """A request's sampling: each given value checked (temperature in [0, 2], 0 meaning greedy; top_p in
        (0, 1]; top_k >= 0, at most `max_top_k` where given, 0 meaning no filter; threshold in [0, 1]; factor > 0; remasking one
        of `rules`, the engine's family's; stop_ids at most MAX_STOP_IDS token ids of the vocabulary), None taking
        the engine's default."""
        temperature = defaults.temperature if temperature is None else check.real("temperature", temperature, low=0,
                                                                                  high=2)
        top_p = defaults.top_p if top_p is None else check.real("top_p", top_p, low=0, high=1, low_open=True)
        top_k = defaults.top_k if top_k is None else check.integer("top_k", top_k, minimum=0)
        if max_top_k is not None and top_k > max_top_k:
            raise ValueError(f"top_k={top_k} exceeds the {max_top_k} this engine was started with (its compiled step "
                             "selects a static number of candidates: max_top_k, dllm-jax serve --max-top-k)")
        threshold = None if threshold is None else float(check.real("threshold", threshold, low=0, high=1))
        factor = None if factor is None else float(check.real("factor", factor, low=0, low_open=True))
        if remasking is not None and not rules:
            raise ValueError(f"remasking={remasking!r}: this server's model has no remasking rule a request may choose")
        if remasking is not None:
            check.choice("remasking", remasking, rules)
        return SamplingValues(float(temperature), float(top_p), int(top_k), threshold, remasking,
                              self.checked_stop_ids(stop_ids), factor)

    def checked_stop_ids(self, stop_ids) -> tuple[int, ...]:
        """A request's own stop token ids (None: none), checked: at most MAX_STOP_IDS ids of the vocabulary."""
        if stop_ids is None:
            return ()
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
            raise ValueError(f"stop_ids must be a list of token ids, got {stop_ids!r}")
        ids = tuple(check.integer("stop_ids", i, minimum=0, maximum=self.config.vocab_size - 1) for i in stop_ids)
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_ids holds {len(ids)} token ids; a request may set at most {MAX_STOP_IDS}")
        return ids

    def stop_ids(self, own: tuple[int, ...]) -> set[int]:
        """The token ids that end a request's answer: the model's and the request's `own`."""
        return set(self.config.stop_ids) | set(own)

    def checked_prompt(self, prompt_ids, max_new_tokens: int, seed: int) -> tuple[np.ndarray, int, int]:
        """(int32 prompt [P], max_new_tokens, seed) after the checks every engine makes."""
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1:
            raise ValueError(f"prompt_ids must be one prompt [length], got shape {prompt.shape}")
        check_prompt(self.config, prompt[None], None)
        max_new_tokens = check.integer("max_new_tokens", max_new_tokens, minimum=1)
        seed = check.integer("seed", seed, minimum=0, maximum=2**31 - 1)
        return prompt.astype(np.int32), max_new_tokens, seed

    def submit(self, prompt_ids, max_new_tokens: int, seed: int = 0, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, *, threshold: float | None = None,
               remasking: str | None = None, stop_ids=None, factor: float | None = None) -> int:
        """Queues a request (prompt_ids: int [P], P >= 1; its own temperature, top-p, top-k, confidence
        threshold, Fast-dLLM factor and remasking rule, None for the engine's; stop_ids, token ids that end its answer besides the
        model's stop ids) and returns its id; ValueError before anything is queued for a request
        the model or the engine cannot take (`check`)."""
        request = Request(self.next_id, *self.check(prompt_ids, max_new_tokens, seed, temperature, top_p, top_k,
                                                    threshold=threshold, remasking=remasking, stop_ids=stop_ids,
                                                    factor=factor))
        self.next_id += 1
        self.queue.append(request)
        return request.request_id

    def cancel(self, request_id: int) -> bool:
        """Drops a queued request; False if none has this id."""
        for i, request in enumerate(self.queue):
            if request.request_id == request_id:
                del self.queue[i]
                return True
        return False
