"""An asyncio HTTP app (aiohttp) that streams an embedded hybridgate Router's answer as server-sent events.

    python examples/sse_app.py --worker ipc:///tmp/hg/worker-0.sock --port 8080
    curl -N 'http://127.0.0.1:8080/ask?q=What+is+the+capital+of+France%3F'
    # data: {"text": "The"}  ...  event: done / data: {"finish_reason": "eos", "completion_tokens": 8}

One Router for the app (opened on start-up, closed on clean-up); each request is one `router.generate`.
A client that disconnects ends the handler, which leaves the `async with` and aborts the request on its worker.
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from hybridgate.models import default_model_path
from hybridgate.router import InvalidRequestError, Router
from hybridgate.wire import SamplingParams

ROUTER = web.AppKey("router", Router)


async def ask(request: web.Request) -> web.StreamResponse:
    question = request.query.get("q", "")
    chat = [{"role": "user", "content": question}]
    try:
        stream = request.app[ROUTER].generate(chat, SamplingParams(temperature=0, max_tokens=64))
    except InvalidRequestError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async with stream:
        async for delta in stream:
            if delta.text:
                await response.write(f"data: {json.dumps({'text': delta.text})}\n\n".encode())
            if delta.finish_reason is not None:
                done = {"finish_reason": delta.finish_reason.name.lower(),
                        "completion_tokens": delta.usage.completion_tokens}
                await response.write(f"event: done\ndata: {json.dumps(done)}\n\n".encode())
    await response.write_eof()
    return response


def make_app(model: str, workers: list[str]) -> web.Application:
    app = web.Application()
    app.router.add_get("/ask", ask)

    async def router_context(app: web.Application):
        async with Router(model, workers) as router:
            app[ROUTER] = router
            yield

    app.cleanup_ctx.append(router_context)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="append", required=True, help="a hybridgate worker's endpoint; repeat")
    parser.add_argument("--model", default=None, help="the GGUF the workers serve (default: hybridgate's default)")
    parser.add_argument("--port", type=int, default=8080, help="port on 127.0.0.1 (0 picks a free one)")
    args = parser.parse_args()
    web.run_app(make_app(args.model or str(default_model_path()), args.worker), host="127.0.0.1", port=args.port,
                print=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
