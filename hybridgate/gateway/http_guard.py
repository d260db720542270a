"""What every HTTP request meets before the app: the bearer token and the body-size limit, as one ASGI wrapper.

FastAPI reads and parses a whole body before any handler or dependency runs,
and its own routes (/openapi.json, 404s) run no app-level dependency at all; so
both checks sit outside it, in front of every route:

- the bearer token (hybridgate.gateway.auth) on every path but `/health`
  (401 with `WWW-Authenticate: Bearer`);
- a POST's Content-Type: every POST route takes a JSON body, and one sent as
  another type or none (curl -d's form encoding, text/plain) is refused with
  415 naming Content-Type rather than parsed anyway: FastAPI reads only JSON
  types as JSON (its `strict_content_type`), so that a web page cannot make a
  browser POST to a local gateway without the CORS preflight a JSON type
  triggers;
- at most `MAX_BODY_BYTES` of body: a `Content-Length` over it is refused
  before a byte is read; a body without one (chunked) is read here up to the
  limit and refused as soon as it passes it, otherwise replayed to the app
  (413 with `Connection: close`, the remainder unread).

Refusals carry the OpenAI error envelope {"error": {"message", "type", "param", "code"}}
(https://platform.openai.com/docs/guides/error-codes), as the app's own errors do.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from hybridgate.gateway.auth import HEADER as AUTH_HEADER
from hybridgate.gateway.auth import bearer_ok

MAX_BODY_BYTES = 4 << 20  # as the gRPC port's largest message (RESOURCE_EXHAUSTED above it)
# The scope key of the server's own `send`, for a streamed body's chunks: FastAPI's middleware wraps `send`
# twice only to note the response's start, an await each per chunk that a chunk does not need.
SERVER_SEND = "hybridgate.server_send"
OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no token

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def send_error(send: Send, status: int, kind: str, message: str, code: str | None = None,
                     headers: tuple[tuple[bytes, bytes], ...] = (), param: str | None = None) -> None:
    """Answer `status` with the OpenAI error envelope (ASGI http.response.start and .body)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def json_media_type(content_type: str | None) -> bool:
    """Whether a body of this Content-Type is JSON to FastAPI: application/json or application/*+json, with
    or without parameters. FastAPI hands any other body, or one without a Content-Type, to validation as bytes."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class HttpGuard:
    """An ASGI app that checks the token and the body size of each HTTP request, then runs `app`.

    `token`: GatewayConfig.auth_token (None or empty: authentication off). `max_body_bytes`: the
    largest body taken (default MAX_BODY_BYTES).
    """

    def __init__(self, app, token: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {max_body_bytes}")
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[SERVER_SEND] = send
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope.get("path") not in OPEN_PATHS and not bearer_ok(self.token, headers.get(AUTH_HEADER)):
            await send_error(send, 401, "authentication_error", "a valid `Authorization: Bearer <token>` header is "
                             "required (the gateway's --auth-token)", "invalid_api_key",
                             ((b"www-authenticate", b"Bearer"),))
            return
        if scope.get("method") == "POST" and not json_media_type(headers.get("content-type")):
            given = headers.get("content-type")
            await send_error(send, 415, "invalid_request_error", "the request body must be JSON sent with "
                             "`Content-Type: application/json`, got " + (f"Content-Type {given!r}" if given else
                             "no Content-Type") + " (curl -d sends application/x-www-form-urlencoded unless given "
                             "-H 'Content-Type: application/json')", "unsupported_media_type", param="Content-Type")
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body_bytes:
                await self._too_large(send, length)
                return
            await self.app(scope, receive, send)  # the server reads exactly Content-Length bytes
            return
        replay = await self._read_chunked(receive)
        if replay is None:
            await self._too_large(send, "more")
            return
        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: str) -> None:
        await send_error(send, 413, "invalid_request_error", f"the request body is at most {self.max_body_bytes} "
                         f"bytes, got {size} bytes", "request_too_large", ((b"connection", b"close"),))

    async def _read_chunked(self, receive: Receive) -> Receive | None:
        """Read a body of unknown length up to the limit; a `receive` that replays it (None: over the limit).
        After the body, the replay passes on what the server sends next (http.disconnect)."""
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                parts.append(message)  # a disconnect: the app learns it when it reads
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(p for p in parts if isinstance(p, bytes))
        pending = [{"type": "http.request", "body": body, "more_body": False},
                   *(p for p in parts if isinstance(p, dict))]

        async def replay() -> dict:
            return pending.pop(0) if pending else await receive()

        return replay
