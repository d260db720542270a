"""grpc.aio's own cost per streamed message: the floor under the gateway's gRPC door.

`bench gateway --grpc-floor` runs this server beside the gateway and drives
both with the same client. It serves the gateway's `Generation` service on
grpc.aio and uvloop, as the gateway does, and does the least a servicer can:
each `Generate` call yields `max_tokens` `GenerateResponse` messages of one
id each (built per message, as the door builds them), one per step of
`step_s` seconds (> 0) for every open stream at once (one timer for all of
them, as one worker step feeds every stream). There is no router, worker,
detokenizer, admission or auth behind it.

Its CPU per message is what any grpc.aio server pays for the C core's write,
the completion queue's wake-up of the event loop and the async generator
(measured: 39.1 µs a message at 64 streams and 10 ms steps on an idle 2-core
Xeon, a third of it system time: docs/results/gateway/2026-12-06-xeon-emr-instant-worker-grpc-floor-idle.json);
the gateway's figure less this one is what the gateway itself adds, and that
difference holds across machines where the absolute figures do not.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from multiprocessing.connection import Connection

TEXT_ID = 278  # one id and its text: the message's size is what matters, not which id
TEXT = " the"


def serve(conn: Connection, step_s: float) -> None:
    """Process entry point (spawn): bind 127.0.0.1 on a free port, send the port on `conn`, serve until
    terminated."""
    import uvloop

    uvloop.install()
    asyncio.run(_serve(conn, step_s))


async def _serve(conn: Connection, step_s: float) -> None:
    import grpc

    from hybridgate.v1 import generation_pb2 as pb
    from hybridgate.v1 import generation_pb2_grpc as pb_grpc

    tick: list[asyncio.Event] = [asyncio.Event()]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(step_s)
            event, tick[0] = tick[0], asyncio.Event()
            event.set()

    class Floor(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            for index in range(request.max_tokens):
                await tick[0].wait()
                yield pb.GenerateResponse(request_id="floor", token_index=index, text=TEXT, token_ids=[TEXT_ID])

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    timer = asyncio.ensure_future(ticker())
    conn.send(port)
    conn.close()
    try:
        await server.wait_for_termination()
    finally:
        timer.cancel()


class FloorServer:
    """The floor server as a child process; `target` to connect to, `pid` whose CPU to read."""

    def __init__(self, step_s: float):
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=serve, args=(theirs, step_s), name="bench-grpc-floor", daemon=True)
        self.proc.start()
        theirs.close()
        if not ours.poll(60):
            self.stop()
            raise RuntimeError("the grpc.aio floor server did not start within 60 s")
        self.target = f"127.0.0.1:{ours.recv()}"
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(30)
