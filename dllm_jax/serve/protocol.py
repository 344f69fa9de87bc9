"""The OpenAI completions and chat-completions protocol as the server speaks it: request bodies (strict:
unknown or mistyped fields are refused), response and stream-chunk objects, and the error object.

A request's `temperature`, `top_p` and `top_k` (not OpenAI's field; vLLM's and SGLang's) are its own (the
server's, `dllm-jax serve --temperature / --top-p / --top-k`, where it sets none; a lockstep server, LLaDA or
Dream, takes those its family samples with and generates a sampled request alone); the other sampling options
are the server's. `temperature: 0` is greedy.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's; vLLM's and SGLang's extension (0: no filter)
    threshold: float | None = Field(default=None, ge=0, le=1)  # this server's extension: the remasking's threshold
    factor: float | None = Field(default=None, gt=0)  # this server's extension: Fast-dLLM's factor rule (LLaDA)
    remasking: str | None = None  # this server's extension: the family's remasking rule (checked by the engine)
    stop_token_ids: list[int] | None = None  # vLLM's extension: token ids that end the answer besides the model's
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return tuple(stops)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]  # text, token ids, or a list of one text
    echo: Literal[False] = False


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish_reason: str | None, *, chat: bool, chunk: bool) -> dict:
    """A completion (chunk=False) or one stream chunk of it, for /v1/completions or (chat) /v1/chat/completions."""
    if chat:
        body = {"delta": {"role": "assistant", "content": text}} if chunk else {
            "message": {"role": "assistant", "content": text}}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        body, obj = {"text": text, "logprobs": None}, "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [{"index": 0, **body, "finish_reason": finish_reason}]}
