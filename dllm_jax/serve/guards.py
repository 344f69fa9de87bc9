"""What the server checks of a request before the app reads it (ASGI middleware): its API key and its size.

`ApiKey`: with a key set, every path under /v1 needs `Authorization: Bearer <key>` (compared in constant time);
anything else gets 401 with OpenAI's error object. `/health` and `/metrics` stay open, as vLLM's and SGLang's do:
load balancers and Prometheus scrapers call them without credentials, and neither reveals a prompt or an answer.
`BodyLimit`: a body past `limit` bytes gets 413, before the rest of it is read: at once when its Content-Length
says so, else as soon as the bytes received pass the limit (a chunked body).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from dllm_jax.serve.protocol import error_body

PROTECTED = "/v1"


async def send_error(send, status: int, message: str, kind: str, code: str | None = None,
                     headers: tuple = ()) -> None:
    body = json.dumps(error_body(message, kind, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def checked_key(key, name: str) -> str | None:
    """An API key as `ApiKey` compares it (surrounding blanks dropped), or None for none; a ValueError naming `name`
    for anything but a non-empty string of printable characters."""
    if key is None:
        return None
    if not (isinstance(key, str) and key.strip() and key.isprintable()):
        raise ValueError(f"{name} must be a non-empty key of printable characters (or none at all)")
    return key.strip()


def header(scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


class ApiKey:
    """401 for a request under /v1 whose `Authorization` header is not `Bearer <key>`."""

    def __init__(self, app, *, key: str, refused: Callable[[int], None] = lambda status: None):
        self.app, self.key, self.refused = app, key.encode(), refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = header(scope, b"authorization") or b""
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                self.refused(401)
                what = "no API key" if not given else "an incorrect API key"
                await send_error(send, 401, f"the request carries {what}: send the header 'Authorization: Bearer "
                                 "<key>' with the key the server was started with (dllm-jax serve --api-key)",
                                 "invalid_request_error", code="invalid_api_key",
                                 headers=((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a request body past `limit` bytes; the app gets the body only once all of it has arrived within it."""

    def __init__(self, app, *, limit: int, refused: Callable[[int], None] = lambda status: None):
        self.app, self.limit, self.refused = app, limit, refused

    async def refuse(self, send, received: str) -> None:
        self.refused(413)
        await send_error(send, 413, f"the request body ({received}) exceeds the server's limit of {self.limit:,} bytes "
                         "(dllm-jax serve --max-request-bytes)", "invalid_request_error", code="request_too_large",
                         headers=((b"connection", b"close"),))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self.refuse(send, f"{int(length):,} bytes by its Content-Length")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(send, f"more than {size:,} bytes")
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)
