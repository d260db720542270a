"""The in-process worker client: an engine on a thread of this process (tests, embedding)."""

from __future__ import annotations

import asyncio
import os
import threading

from hybridgate.clients.local import LocalWorkerClient
from hybridgate.wire import Abort, AddRequest, EngineStats, Hello
from hybridgate.workers.engine import EngineCore, ModelRunner
from hybridgate.workers.engine_loop import EngineLoop, Inbox
from hybridgate.workers.scheduler import SchedulerConfig


class InProcessClient(LocalWorkerClient):
    """Same interface as the router's `ZmqWorkerClient`, over a thread instead of a socket, and the
    same lifecycle (`LocalWorkerClient`): READY once started, DEAD should its engine thread end.

    `runner` is built by the caller (e.g. `TorchRunner(load_gguf(path))`);
    `fingerprint` is the model's, for the router's check.
    """

    endpoint = "inproc"

    def __init__(self, runner: ModelRunner, fingerprint: str, scheduler: SchedulerConfig | None = None,
                 prefix_caching: bool = True):
        self.kind = runner.kind
        scheduler = scheduler or SchedulerConfig()
        self.hello = Hello(kind=runner.kind, fingerprint=fingerprint, max_num_seqs=scheduler.max_num_seqs,
                           max_model_len=runner.max_model_len, pid=os.getpid(), ready=True,
                           cpu_isa=getattr(runner, "cpu_isa", ""),
                           kv_dtype=runner.kv_layout().dtype if hasattr(runner, "kv_layout") else "")
        self.engine = EngineCore(runner, scheduler, fingerprint, prefix_caching)
        self.inbox = Inbox(scheduler.max_num_waiting, self.engine.refusals)
        self._loop_thread: threading.Thread | None = None
        self._engine_loop: EngineLoop | None = None

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    async def start(self, on_message) -> None:
        loop = asyncio.get_running_loop()

        def send(client: bytes, msg) -> None:
            loop.call_soon_threadsafe(on_message, self, msg)

        def run() -> None:
            try:
                self._engine_loop.run()
            finally:
                if not self._engine_loop.stopping.is_set():  # an engine that ends by itself is a lost worker
                    loop.call_soon_threadsafe(self.lost, "its engine thread ended")

        self._start_lifecycle(on_message)
        self._engine_loop = EngineLoop(self.engine, self.inbox, send)
        self._loop_thread = threading.Thread(target=run, name="inprocess-engine", daemon=True)
        self._loop_thread.start()
        self.come_up()

    def add(self, request: AddRequest) -> None:
        if not self.inbox.offer_add(b"", request):
            self._engine_loop.send(b"", self.inbox.refusal(request.request_id))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.inbox.put_abort(b"", Abort(request_ids))

    async def close(self) -> None:
        if self._engine_loop is not None:
            self._engine_loop.stopping.set()
            self.inbox.requests.put(None)
            await asyncio.to_thread(self._loop_thread.join, 5)
