"""A worker client that replays scripted token ids: for stop-string splits and worker death,
faults and token sequences the real model cannot be made to produce on demand."""

from __future__ import annotations

import asyncio

from hybridgate.clients.local import LocalWorkerClient
from hybridgate.wire import EngineStats, FinishReason, Hello, Outputs, SeqOutput, TokenLogprobs


def scripted_logprob(i: int) -> TokenLogprobs:
    """The log-probability a ScriptedClient sends with its `i`-th id when the request asks for them."""
    return TokenLogprobs(-(i + 1) / 8)


class ScriptedClient(LocalWorkerClient):
    def __init__(self, fingerprint: str, script: list[int], *, finish=FinishReason.LENGTH, die_after: int | None = None,
                 kind: str = "gpu", max_model_len: int = 8192, stall_after: int | None = None):
        self.endpoint = f"scripted-{id(self)}"
        self.kind, self.stats = kind, EngineStats()
        self.hello = Hello(kind, fingerprint, 8, max_model_len, 0, True)
        self.script, self.finish, self.die_after = script, finish, die_after
        self.stall_after = stall_after  # the index of the last id sent: a worker that stalls after it
        self.requests, self.aborted = [], []
        self._tasks = []

    async def start(self, on_message) -> None:
        self._start_lifecycle(on_message)
        self.come_up()

    def add(self, request) -> None:
        self.requests.append(request)
        self._tasks.append(asyncio.get_running_loop().create_task(self._play(request)))

    async def _play(self, request) -> None:
        for i, tid in enumerate(self.script):
            await asyncio.sleep(0)
            if self.die_after is not None and i >= self.die_after:
                self.lost("killed by signal SIGKILL")
                return
            if request.request_id in self.aborted or self.stall_after is not None and i > self.stall_after:
                return
            last = i == len(self.script) - 1
            logprobs = [scripted_logprob(i)] if request.params.logprobs is not None else []
            out = SeqOutput(request.request_id, i, [tid], finish=int(self.finish) if last else 0, logprobs=logprobs)
            self._on_message(self, Outputs([out], self.stats))

    def abort(self, request_ids) -> None:
        self.aborted += request_ids

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
