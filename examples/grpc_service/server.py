"""A user's own grpc.aio service whose handler streams answers from an embedded hybridgate Router.

    python examples/grpc_service/server.py --worker ipc:///tmp/hg/worker-0.sock --port 50070
    # then, from another program: assistant_pb2_grpc.AssistantStub(channel).Ask(AskRequest(question="Hi!"))

The service (`assistant.proto` beside this file; `assistant_pb2*.py` were generated from it with
`python -m grpc_tools.protoc -I examples/grpc_service --python_out=examples/grpc_service
--grpc_python_out=examples/grpc_service examples/grpc_service/assistant.proto`) is not hybridgate's API:
the Router is a library here, the workers are hybridgate workers (`hybridgate worker --endpoint ...`).
A client that cancels its call leaves the router's `async with`, which aborts the request on its worker.
Ctrl-C (SIGINT) or SIGTERM stops the service: calls in flight get a second, then the router closes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

import assistant_pb2
import assistant_pb2_grpc
from hybridgate.models import default_model_path
from hybridgate.router import InvalidRequestError, Router, UnavailableError
from hybridgate.wire import SamplingParams


class Assistant(assistant_pb2_grpc.AssistantServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Ask(self, request: assistant_pb2.AskRequest, context: grpc.aio.ServicerContext):
        chat = [{"role": "user", "content": request.question}]
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens or 64)
        try:
            async with self.router.generate(chat, params) as stream:
                async for delta in stream:
                    if delta.finish_reason is None:
                        yield assistant_pb2.AskReply(text=delta.text)
                    else:
                        yield assistant_pb2.AskReply(text=delta.text, done=True,
                                                     finish_reason=delta.finish_reason.name.lower())
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="append", required=True, help="a hybridgate worker's endpoint; repeat")
    parser.add_argument("--model", default=None, help="the GGUF the workers serve (default: hybridgate's default)")
    parser.add_argument("--port", type=int, default=50070, help="port on 127.0.0.1 (0 picks a free one)")
    args = parser.parse_args()
    async with Router(args.model or default_model_path(), args.worker) as router:
        server = grpc.aio.server()
        assistant_pb2_grpc.add_AssistantServicer_to_server(Assistant(router), server)
        port = server.add_insecure_port(f"127.0.0.1:{args.port}")
        await server.start()
        print(f"assistant on 127.0.0.1:{port}", flush=True)
        # As hybridgate's own gateway does: the handlers only set a flag, and the stop happens here, where
        # the streams in flight get their grace period before the router's `async with` closes.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            print("assistant: stopping (in-flight streams get 1 s)", flush=True)
        finally:
            await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main())
