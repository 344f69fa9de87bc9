"""The engine's thread: HTTP handlers (asyncio) hand it jobs; it steps the engine and hands back text.

JAX calls block, so the engine runs in a thread of its own. A handler checks its request against the
engine (`Engine.check`, any thread), then `Worker.submit` queues a `Job` and returns a `Ticket`, whose asyncio
queue receives the request's `Event`s: text deltas as blocks are decoded, then one final event (its text and
why it ended) or an error. Between engine steps the thread takes new jobs and cancellations (a client that went
away frees its slot at the next step), decodes every running request's final tokens so far (a decoded block
never changes), cuts at stop strings, and ends finished requests. Every accepted job ends with exactly one
final event: its completion, or an error. A failure that belongs to one request (the engine refuses it, its
text cannot be decoded) ends that request alone with its error; only a failing engine step ends them all.
Tickets are tracked by identity (a job holds a numpy prompt, which has no truth value to compare by).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from dllm_jax.serve.engine import Engine

log = logging.getLogger("dllm_jax.serve")


class QueueFull(Exception):
    """The bounded queue of waiting jobs is full (HTTP 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new jobs (HTTP 503)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
    prompt_ids: np.ndarray  # int32 [P], checked by Engine.check
    max_tokens: int
    seed: int
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    temperature: float | None = None  # None: the engine's
    top_p: float | None = None
    top_k: int | None = None
    threshold: float | None = None  # None: the engine's
    remasking: str | None = None  # None: the engine's
    stop_ids: tuple[int, ...] = ()  # token ids that end the answer, besides the model's
    factor: float | None = None  # None: the engine's


@dataclasses.dataclass(frozen=True)
class Event:
    """`delta`: new text. A final event (`finish_reason` set, or `error`) is the request's last."""

    delta: str = ""
    finish_reason: str | None = None  # "stop" (a stop token or string) or "length" (max_tokens)
    completion_tokens: int = 0
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclasses.dataclass(eq=False)
class Ticket:
    """One accepted job as the engine thread tracks it (mutated only on that thread, except `queue`'s reader)."""

    job: Job
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float
    request_id: int | None = None  # the engine's, once submitted to it
    sent: str = ""  # text handed to the client so far
    first_block: float | None = None  # when the first decoded block arrived

    def put(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is left to read it
            pass


@dataclasses.dataclass(frozen=True)
class Observer:
    """Callbacks the engine thread reports to (the metrics); each takes seconds or a count."""

    first_block: Callable[[float], None] = lambda seconds: None
    finished: Callable[[float, int], None] = lambda seconds, tokens: None  # latency, generated tokens
    cancelled: Callable[[], None] = lambda: None  # a request left before its end (its client went away)


class Worker:
    """Runs `engine` on a thread; `decode(ids) -> str` turns generated ids into text."""

    def __init__(self, engine: Engine, decode: Callable[[np.ndarray], str], *, max_queue: int,
                 observer: Observer = Observer()):
        self.engine, self.decode, self.max_queue, self.observer = engine, decode, max_queue, observer
        self.lock = threading.Condition()
        self.inbox: list[Ticket] = []
        self.cancelled: list[Ticket] = []
        self.tickets: dict[int, Ticket] = {}  # engine request id -> ticket (queued in the engine or running)
        self.draining = False
        self.failure: str | None = None
        self.thread = threading.Thread(target=self.loop, name="dllm-jax-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.failure is None

    def waiting(self) -> int:
        """Jobs accepted and not yet in a slot."""
        with self.lock:
            return len(self.inbox) + len(self.engine.queue)

    def submit(self, job: Job) -> Ticket:
        """Queues a job (QueueFull past max_queue waiting jobs, Draining once shutting down)."""
        ticket = Ticket(job, asyncio.Queue(), asyncio.get_running_loop(), time.perf_counter())
        with self.lock:
            if self.draining or self.failure is not None:
                raise Draining("the server is shutting down" if self.draining else f"the engine failed: {self.failure}")
            if len(self.inbox) + len(self.engine.queue) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting for a slot; retry later")
            self.inbox.append(ticket)
            self.lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: its request leaves the engine at the next step."""
        with self.lock:
            self.cancelled.append(ticket)
            self.lock.notify()

    def stop(self) -> None:
        """Takes no new jobs, finishes the accepted ones, then the thread ends (join it)."""
        with self.lock:
            self.draining = True
            self.lock.notify()

    def loop(self) -> None:
        try:
            while self.turn():
                pass
        except Exception as e:  # noqa: BLE001  (every accepted job must end: with an error, then)
            with self.lock:
                self.failure = f"{type(e).__name__}: {e}"
                lost = list(self.tickets.values()) + self.inbox
                self.inbox.clear()
                self.tickets.clear()
            for ticket in lost:
                ticket.put(Event(error=f"the engine failed: {self.failure}"))
            raise

    def turn(self) -> bool:
        """Takes new jobs and cancellations, steps the engine once and reports; False when drained."""
        with self.lock:
            while not (self.inbox or self.cancelled or self.tickets or self.draining):
                self.lock.wait()
            if self.draining and not (self.inbox or self.tickets):
                return False
            new, self.inbox = self.inbox, []
            cancelled, self.cancelled = self.cancelled, []
            for ticket in cancelled:
                if ticket in new:  # by identity (Ticket's eq=False)
                    new.remove(ticket)
                    self.observer.cancelled()
                elif ticket.request_id is not None and self.tickets.get(ticket.request_id) is ticket:
                    del self.tickets[ticket.request_id]
                    self.engine.cancel(ticket.request_id)
                    self.observer.cancelled()
                # else it has ended already (answered or failed): nothing to free
            for ticket in new:
                job = ticket.job
                try:
                    ticket.request_id = self.engine.submit(job.prompt_ids, job.max_tokens, job.seed, job.temperature,
                                                           job.top_p, job.top_k, threshold=job.threshold,
                                                           remasking=job.remasking, stop_ids=job.stop_ids,
                                                           factor=job.factor)
                except Exception as e:  # noqa: BLE001  (checked by the handler already; still, it fails alone)
                    self.fail(ticket, e)
                    continue
                self.tickets[ticket.request_id] = ticket
        if not self.tickets:
            return True
        completions = {c.request_id: c.generated for c in self.engine.step()}
        progress = self.engine.progress() | completions
        for request_id, tokens in progress.items():
            ticket = self.tickets.get(request_id)
            if ticket is None:
                continue
            try:
                self.report(ticket, tokens, done=request_id in completions)
            except Exception as e:  # noqa: BLE001  (a request whose text fails ends alone; the others go on)
                with self.lock:
                    self.tickets.pop(request_id, None)
                if request_id not in completions:
                    self.engine.cancel(request_id)
                self.fail(ticket, e)
        return True

    def covering(self, tokens: np.ndarray, length: int) -> int:
        """The fewest of `tokens` whose text holds its first `length` characters (a prefix's text grows with it)."""
        low, high = 0, len(tokens)
        while low < high:
            middle = (low + high) // 2
            if len(self.decode(tokens[:middle])) >= length:
                high = middle
            else:
                low = middle + 1
        return low

    def fail(self, ticket: Ticket, error: Exception) -> None:
        """Ends one request with its error: a ValueError's message (a refusal) as it is; anything else is logged
        with its traceback and named to the client by its type only."""
        if isinstance(error, ValueError):
            message = str(error)
        else:
            log.error("a request failed", exc_info=error)
            message = f"the request failed ({type(error).__name__}); the server's log has the details"
        ticket.put(Event(error=message))

    def report(self, ticket: Ticket, tokens: np.ndarray, *, done: bool) -> None:
        """Sends the ticket's new text; ends it at a stop string, a stop token or max_tokens."""
        job = ticket.job
        now = time.perf_counter()
        if len(tokens) and ticket.first_block is None:
            ticket.first_block = now
            self.observer.first_block(now - ticket.submitted)
        kept = tokens[:job.max_tokens]
        text = self.decode(kept)
        cut, stop = min(((text.find(s), s) for s in job.stop if s in text), default=(-1, ""))
        stop_token = len(kept) and int(kept[-1]) in self.engine.stop_ids(job.stop_ids)
        if cut >= 0:  # the answer's tokens end with the one that completes the stop string (vLLM's count)
            reason, text = "stop", text[:cut]
            kept = kept[:self.covering(kept, cut + len(stop))]
        elif done or len(tokens) >= job.max_tokens:
            reason = "stop" if stop_token else "length"
        else:  # still running: hold back what could be the start of a stop string
            hold = max((len(s) - 1 for s in job.stop), default=0)
            shown = text[:len(text) - hold] if hold else text
            if shown.startswith(ticket.sent) and len(shown) > len(ticket.sent):
                ticket.put(Event(delta=shown[len(ticket.sent):]))
                ticket.sent = shown
            return
        delta = text[len(ticket.sent):] if text.startswith(ticket.sent) else ""
        ticket.put(Event(delta=delta, finish_reason=reason, completion_tokens=len(kept)))
        self.observer.finished(now - ticket.submitted, len(kept))
        with self.lock:
            self.tickets.pop(ticket.request_id, None)
        if not done:  # a stop string or max_tokens before the engine's last block: free the slot now
            self.engine.cancel(ticket.request_id)
