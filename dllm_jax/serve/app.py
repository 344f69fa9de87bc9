"""The OpenAI-compatible HTTP server (FastAPI): `POST /v1/completions`, `POST /v1/chat/completions` (the
checkpoint's chat template; `stream: true` sends each decoded block as a server-sent event), `GET /v1/models`,
`GET /health` and Prometheus `GET /metrics`, over one `Worker` (the engine's thread).

Bad requests (malformed JSON, unknown or mistyped fields, out-of-range values, text that is not valid Unicode, a
prompt that does not fit the context, a sampling value the family has no option for) get HTTP 400 with OpenAI's
error object; a missing or wrong API key (`api_key` set) 401; an unknown model or path 404; a body past
`max_request_bytes` 413; a full queue 429; an unexpected failure 500 (its details in the server's log, none sent);
a server that is shutting down or whose engine failed 503. A client that disconnects, streaming or not, cancels
its request: its slot is free at the next step, and the metrics count it as cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import secrets
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.exceptions import HTTPException

from dllm_jax import validation as check
from dllm_jax.families import family_of
from dllm_jax.serve import protocol
from dllm_jax.serve.engine import Engine
from dllm_jax.serve.guards import ApiKey, BodyLimit, checked_key
from dllm_jax.serve.lockstep import LockstepEngine
from dllm_jax.serve.worker import Draining, Event, Job, Observer, QueueFull, Ticket, Worker

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
MAX_REQUEST_BYTES = 4 * 2**20  # a request body's default limit: a 128k-token prompt as text or as ids fits
TOKENIZE_SECONDS = 30.0  # a prompt's tokenization (and chat template) that takes longer is refused
TOKENIZE_THREADS = 2  # prompts tokenized at once, off the event loop: a huge one cannot hold up the others' replies
POLL_SECONDS = 0.25  # how often a non-streaming handler looks for its client's disconnect between events
CLIENT_CLOSED = 499  # the status logged for a request whose client went away (nginx's); nobody receives it


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, protocol.error_body(message, kind, param, code)


class Metrics:
    """The server's Prometheus metrics, on a registry of their own (one per app); `watch` adds the gauges that
    read a worker."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.tokens = Counter("dllm_generated_tokens", "tokens returned to clients (rate(): tokens/s)", registry=r)
        self.requests = Counter("dllm_requests", "requests by outcome", ["outcome"], registry=r)
        self.first_block = Histogram("dllm_time_to_first_block_seconds", "from arrival to the first decoded block",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("dllm_request_latency_seconds", "from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def observer(self) -> Observer:
        def finished(seconds: float, tokens: int) -> None:
            self.latency.observe(seconds)
            self.tokens.inc(tokens)

        return Observer(first_block=self.first_block.observe, finished=finished, cancelled=lambda: self.count("cancelled"))

    def count(self, outcome) -> None:
        """One request ended: "200", an error status, or "cancelled" (its client went away first)."""
        self.requests.labels(outcome=str(outcome)).inc()

    def watch(self, worker: Worker) -> None:
        r = self.registry
        Gauge("dllm_queue_depth", "requests accepted and waiting for a slot", registry=r).set_function(worker.waiting)
        Gauge("dllm_active_slots", "slots holding a request", registry=r).set_function(lambda: worker.engine.busy)
        Gauge("dllm_slots", "the engine's slots", registry=r).set(worker.engine.slots)
        prefix = getattr(worker.engine, "prefix", None)  # the slot engine's prefix cache
        if prefix is not None:
            r.register(PrefixCacheCounters(prefix))


class PrefixCacheCounters:
    """A Prometheus collector of the prefix cache's counters (the engine's own, read at each scrape)."""

    def __init__(self, prefix):
        self.prefix = prefix

    def collect(self):
        yield CounterMetricFamily("dllm_prefix_cache_hit_tokens", "prompt positions whose K/V the prefix cache held",
                                  value=self.prefix.hit_tokens)
        yield CounterMetricFamily("dllm_prefix_cache_query_tokens", "prompt positions looked up in the prefix cache",
                                  value=self.prefix.query_tokens)


def build_app(model, tokenizer, *, model_name: str, slots: int = 8, max_context: int | None = None, method=None,
              max_queue: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              max_top_k: int | None = None, overlap: bool | None = None, schedule: str | None = None,
              prefix_cache_bytes: int = 0, prefill_batch: int | None = None, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, **options) -> FastAPI:
    """An engine for `model`, its worker and the app over them: the slot `Engine` for the block-diffusion families
    (SDAR, LLaDA2; `options`: the family's other generate options; `temperature`, `top_p` and `top_k` are the
    defaults of a request that sets none, each request sampling with its own: temperature 0 decodes greedily,
    SDAR with top-k 1; a request's top-k at most `max_top_k`, `Engine`'s), or for the others a `LockstepEngine`
    (greedy requests batched, a sampled one alone unless the family's rows take seeds of their own; `options`: the
    family's generate options, its answer length included). `overlap`, `schedule`, `prefix_cache_bytes` and
    `prefill_batch`: `Engine`'s (None: its defaults, on, "forward" and every slot; 0: no prefix cache). `api_key`,
    `max_request_bytes`: `create_app`'s."""
    max_queue = check.integer("max_queue", max_queue, minimum=1)
    temperature = check.real("temperature", temperature, low=0, high=2)
    top_p = check.real("top_p", top_p, low=0, high=1, low_open=True)
    top_k = check.integer("top_k", top_k, minimum=0)
    loop = family_of(model.config).slots
    if loop is not None:
        # the engine checks the default top-k against its bound (the requests' default is its options' top_k)
        given = dict(overlap=overlap, schedule=schedule, prefill_batch=prefill_batch)
        given = {name: value for name, value in given.items() if value is not None}
        engine = Engine(model, slots=slots, max_context=max_context, method=method, max_top_k=max_top_k,
                        top_k=top_k, prefix_cache_bytes=prefix_cache_bytes, **options | given)
    else:
        if (max_top_k is not None or overlap is not None or schedule is not None or prefix_cache_bytes
                or prefill_batch is not None):
            raise ValueError(f"max_top_k, overlap, schedule, prefix_cache_bytes and prefill_batch are the slot engine's "
                             f"(per-request top-k, overlapped steps, its step schedule, its prefix cache, its batched "
                             f"prefill); {type(model).__name__} "
                             "is served in lockstep batches")
        sampling = {} if temperature == 0 else dict(temperature=temperature)
        sampling |= {} if top_p == 1 else dict(top_p=top_p)
        sampling |= {} if top_k == 0 else dict(top_k=top_k)
        engine = LockstepEngine(model, slots=slots, max_context=max_context, method=method, **(options | sampling))
    skip = model.config.placeholder_ids
    metrics = Metrics()
    worker = Worker(engine, lambda ids: tokenizer.decode(ids, skip=skip), max_queue=max_queue,
                    observer=metrics.observer())
    metrics.watch(worker)
    app = create_app(worker, tokenizer, model_name=model_name, metrics=metrics, temperature=temperature, top_p=top_p,
                     top_k=top_k, api_key=api_key, max_request_bytes=max_request_bytes)
    app.state.engine = engine  # for callers that warm it up (benchmarks/serving.py)
    return app


def create_app(worker: Worker, tokenizer, *, model_name: str, metrics: Metrics, temperature: float,
               top_p: float = 1.0, top_k: int = 0, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The app over a worker whose observer is `metrics.observer()` (`build_app`); the worker starts and stops
    with it. `api_key`: the key every /v1 request must carry (`guards.ApiKey`; None: none asked); a request body
    past `max_request_bytes` gets 413 (`guards.BodyLimit`)."""
    engine = worker.engine
    max_request_bytes = check.integer("max_request_bytes", max_request_bytes, minimum=1)
    api_key = checked_key(api_key, "api_key")
    tokenizing = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="dllm-jax-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # uvicorn has finished the open requests by now; the rest of the queue ends too
        await asyncio.to_thread(worker.thread.join)
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dllm-jax", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes, refused=metrics.count)
    if api_key is not None:  # added last: the outermost, so a request without the key is refused before its body is read
        app.add_middleware(ApiKey, key=api_key, refused=metrics.count)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        metrics.count(e.status)
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # an unknown path (404), a wrong method (405)
        metrics.count(e.status_code)
        message = f"{e.detail}: {request.method} {request.url.path}"
        return JSONResponse(protocol.error_body(message, code=str(e.status_code)), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        metrics.count(500)  # the traceback goes to the server's log (uvicorn's), never to the client
        return JSONResponse(protocol.error_body("the server failed on this request (its log has the details)",
                                                kind="server_error"), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        metrics.count(400)
        return JSONResponse(protocol.error_body(message, param=where or None), status_code=400)

    def job(body: protocol.Sampling, prompt_ids, max_tokens: int | None) -> Job:
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        # the request's own sampling, the server's (dllm-jax serve --temperature / --top-p / --top-k) where it
        # sets none
        t = temperature if body.temperature is None else body.temperature
        p = top_p if body.top_p is None else body.top_p
        k = top_k if body.top_k is None else body.top_k
        try:
            stop = body.stop_strings()
            if max_tokens is None:  # as much as the context leaves (chat), else OpenAI's default of 16
                max_tokens = engine.room(len(prompt_ids)) if isinstance(body, protocol.ChatRequest) else 16
            seed = body.seed if body.seed is not None else (0 if t == 0 else secrets.randbelow(2**31))
            prompt, max_tokens, seed, sampling = engine.check(prompt_ids, max_tokens, seed, t, p, k,
                                                              threshold=body.threshold, remasking=body.remasking,
                                                              stop_ids=body.stop_token_ids, factor=body.factor)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return Job(prompt, max_tokens, seed, stop, temperature=sampling.temperature, top_p=sampling.top_p,
                   top_k=sampling.top_k, threshold=sampling.threshold, remasking=sampling.remasking,
                   stop_ids=sampling.stop_ids, factor=sampling.factor)

    def public(message: str) -> str:
        """An error message as a client may read it: the checkpoint's files named without the server's path."""
        return message.replace(f"{tokenizer.directory}/", "").replace(f"{tokenizer.directory.resolve()}/", "")

    async def tokenized(encode, param: str) -> list[int]:
        """`encode()` on a tokenizing thread (the event loop serves the other clients meanwhile), bounded in time."""
        try:
            future = asyncio.get_running_loop().run_in_executor(tokenizing, encode)
            return await asyncio.wait_for(future, TOKENIZE_SECONDS)
        except TimeoutError:
            raise ApiError(400, f"the {param} took more than {TOKENIZE_SECONDS:.0f} s to tokenize: send a shorter "
                           "one", param=param) from None
        except ValueError as e:
            raise ApiError(400, public(str(e)), param=param) from None

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} texts: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = await tokenized(lambda: tokenizer.encode(prompt, chat=False)[0].tolist(), "prompt")
        return await answer(job(body, prompt, body.max_tokens), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request):
        messages = [m.model_dump() for m in body.messages]
        ids = await tokenized(lambda: tokenizer.encode_messages(messages), "messages")
        return await answer(job(body, ids, body.max_completion_tokens or body.max_tokens), body, request, chat=True)

    async def answer(job: Job, body: protocol.Sampling, request: Request, *, chat: bool):
        try:
            ticket = worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        except Draining as e:
            raise ApiError(503, public(str(e)), kind="server_error") from None
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(ticket, rid, len(job.prompt_ids), chat=chat, usage=usage),
                                     media_type="text/event-stream")
        collected = await collect(ticket, request)
        if collected is None:  # the client went away: its request is cancelled, and nobody reads this reply
            return Response(status_code=CLIENT_CLOSED)
        text, final = collected
        if final.error is not None:
            raise ApiError(500, final.error, kind="server_error")
        metrics.count(200)
        reply = protocol.completion(rid, model_name, text, final.finish_reason, chat=chat, chunk=False)
        return reply | {"usage": protocol.usage(len(job.prompt_ids), final.completion_tokens)}

    async def collect(ticket: Ticket, request: Request) -> tuple[str, Event] | None:
        """The ticket's whole text and final event; None if the client disconnects first (the ticket is cancelled).
        The disconnect is looked for after every event as well as between them: a fast engine sends an event every
        block, so a wait for a quiet moment might never end."""
        parts = []
        while True:
            try:
                event = await asyncio.wait_for(ticket.queue.get(), timeout=POLL_SECONDS)
            except TimeoutError:
                event = None
            if event is not None:
                parts.append(event.delta)
                if event.final:
                    return "".join(parts), event
            if await request.is_disconnected():
                worker.cancel(ticket)
                return None

    async def stream(ticket: Ticket, rid: str, prompt_tokens: int, *, chat: bool, usage: bool):
        done = False
        try:
            while not done:
                event = await ticket.queue.get()
                done = event.final
                if event.error is not None:
                    metrics.count(500)
                    yield sse(protocol.error_body(event.error, kind="server_error"))
                    break
                if event.delta or done:
                    yield sse(protocol.completion(rid, model_name, event.delta, event.finish_reason, chat=chat,
                                                  chunk=True))
                if done and usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": int(time.time()), "model": model_name, "choices": [],
                               "usage": protocol.usage(prompt_tokens, event.completion_tokens)})
            yield "data: [DONE]\n\n"
            if event.error is None:
                metrics.count(200)
        finally:
            if not done:  # the client went away: free the slot (the worker counts it as cancelled)
                worker.cancel(ticket)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "dllm-jax", "max_model_len": engine.max_context}]}

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "unavailable", "reason": worker.failure or "the engine is not running"},
                                status_code=503)
        return {"status": "ok", "slots": engine.slots, "active": engine.busy, "waiting": worker.waiting()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning"):
    """Serves `app` under uvicorn on a free port of `host` in a thread of this process (tests, the load
    generator); yields the base URL, and shuts the server down (its lifespan: the engine drains) on exit."""
    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
