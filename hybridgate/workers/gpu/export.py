"""KV export from the torch runner's paged cache to a CPU worker's hand-off socket.

The engine thread calls `KVExporter.submit()` right after the step that
sampled the sequence's first token; on CUDA it records an event on the
compute stream there, so the copies wait for the step that wrote the last
blocks (never relaxed source ordering) while the engine goes on with its next
step. A sender thread then, per part of whole layers: takes a buffer of the
pinned slab (waiting, with a timeout, when all are in flight; never
allocating), gathers the sequence's blocks of each layer into it on a
dedicated copy stream (`non_blocking=True`), records a copy event, and once
that event completes sends the frames with `copy=False` and a send tracker;
the buffer returns to the pool when the tracker says ZeroMQ is done with it.
Parts are pipelined: the next part's copies are issued before the previous
part is sent. On a CPU torch device the same code runs with a plain slab and
synchronous gathers. Only the layers that own K/V are sent, each frame in its
own layer's shape (gemma4's layers differ), packed by bytes in the buffers.

The copy time "hidden" behind compute is the overlap of each part's copy with
the runner's steps: CUDA events on both streams on CUDA, host clocks on the
CPU (`StepTimeline`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from hybridgate import wire
from hybridgate.security.keys import Transport
from hybridgate.mempool import PinnedPool, aligned_slab
from hybridgate.wire import HandoffPart, HandoffRefused
from hybridgate.workers.guard import Refusals
from hybridgate.workers.handoff import ExportJob, PauseHooks
from hybridgate.workers.threads import worker_thread

log = logging.getLogger("hybridgate.worker")

DEFAULT_BUFFER_MEMORY = 256 << 20
MAX_BUFFERS = 16  # the slab is cut into at most this many buffers (larger buffers: fewer, larger parts)
BUFFER_WAIT_S = 10.0
PARTS_PER_HANDOFF = 10
SOCKET_BUFFER_BYTES = 4 << 20
_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAME[dtype]


class StepTimeline:
    """When the runner's steps ran, to measure how much of a copy overlapped compute.

    CUDA: start and end events of each step on the compute stream (timing
    events, positions relative to one reference event). CPU: host monotonic
    times. Keeps the last `keep` steps.
    """

    def __init__(self, device: torch.device, keep: int = 256):
        self.cuda = device.type == "cuda"
        self._steps: deque = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._open = None
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def begin(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = ev
        else:
            self._open = time.monotonic()

    def end(self) -> None:
        if self._open is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.monotonic()
        with self._lock:
            self._steps.append((self._open, ev))
            self._open = None

    def overlap_s(self, start, end) -> float:
        """Seconds of [start, end] (events on CUDA, monotonic floats on the CPU) during which a step ran."""
        with self._lock:
            steps = list(self._steps)
            current = self._open
        if current is not None:
            steps.append((current, None))
        if self.cuda:
            a, b = self.ref.elapsed_time(start) / 1e3, self.ref.elapsed_time(end) / 1e3
            spans = []
            for s, e in steps:
                if not s.query():
                    continue
                spans.append((self.ref.elapsed_time(s) / 1e3,
                              self.ref.elapsed_time(e) / 1e3 if e is not None and e.query() else float("inf")))
        else:
            a, b = start, end
            spans = [(s, e if e is not None else time.monotonic()) for s, e in steps]
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


@dataclass(frozen=True)
class ExportEvent:
    """Sender thread → engine: an export finished ("sent"), failed ("failed"), was cancelled
    ("cancelled"; blocks no longer read), or its hand-off came back refused ("refused")."""

    key: tuple[bytes, str]
    kind: str
    nbytes: int = 0
    export_s: float = 0.0
    copy_s: float = 0.0
    hidden_s: float = 0.0
    reason: str = ""
    refused: HandoffRefused | None = None


MAX_QUEUED_EXPORTS = 64  # exports waiting for the sender thread; one more fails at once (decoded where it is)


class KVExporter:
    """Gathers, copies and sends KV hand-offs on its own thread; `notify(event)` reaches the engine.

    At most `max_jobs` exports wait for the thread: one more fails at once ("failed", so the
    sequence decodes on this worker) and is counted in `refusals` as "kv_export".
    """

    def __init__(self, runner, ctx: zmq.Context, notify: Callable[[ExportEvent], None],
                 buffer_memory: int = DEFAULT_BUFFER_MEMORY, pauses: PauseHooks | None = None,
                 wait_s: float = BUFFER_WAIT_S, buffer_bytes: int | None = None, transport: Transport | None = None,
                 max_jobs: int = MAX_QUEUED_EXPORTS, refusals: Refusals | None = None):
        """buffer_memory: the slab (the `handoff_buffer_memory` setting). buffer_bytes: one buffer; by
        default the largest layer's K and V of the longest hand-off, which no setting bounds but the runner's
        max model length (a hand-off carries the prompt and its first token), capped at half the slab so
        that two buffers exist (one copying while the other sends), and at least slab / MAX_BUFFERS;
        hand-offs longer than a buffer holds (`max_tokens`) stay on this worker. Tests pass a smaller one.
        transport: CURVE for a CPU worker's tcp:// hand-off socket (None: plain sockets).

        Raises:
            ValueError: naming --handoff-buffer-memory, when it holds fewer than two buffers of a block.
        """
        self.runner, self.ctx, self.notify, self.wait_s = runner, ctx, notify, wait_s
        self.transport = transport
        self.pauses = pauses or PauseHooks()
        cache, dev = runner.cache, runner.model.device
        self.cuda = dev.type == "cuda"
        self.layers = cache.config.kv_layers  # the model layer of each layer sent: those that own K/V (`KVLayout`)
        # one token's K (or V) of each layer sent, in bytes: gemma4's layers differ
        self.rows = [cache.k[i].shape[1] * cache.k[i].shape[2] * cache.k[i].element_size() for i in self.layers]
        bs = cache.block_size
        row_bytes = 2 * max(self.rows)  # one token's K and V, the largest layer
        if buffer_bytes is None:
            # Two buffers at least (one copying while the other sends): a hand-off whose one layer outgrows a
            # buffer fails to export and stays on this worker (the router keeps its stream).
            layer_bytes = -(-runner.max_model_len // bs) * bs * row_bytes
            buffer_bytes = max(buffer_memory // MAX_BUFFERS, min(layer_bytes, buffer_memory // 2))
        num_buffers = buffer_memory // buffer_bytes
        self.max_tokens = buffer_bytes // row_bytes // bs * bs  # the longest hand-off this exporter sends
        if num_buffers < 2 or self.max_tokens < bs:
            raise ValueError(f"--handoff-buffer-memory: {buffer_memory} bytes hold fewer than 2 buffers of one "
                             f"block's K and V of the largest layer ({bs * row_bytes} bytes)")
        log.info("KV hand-offs: %d pinned buffers of %.1f MiB (--handoff-buffer-memory %.1f MiB), one layer's "
                 "K and V of up to %d tokens%s", num_buffers, buffer_bytes / 2**20, buffer_memory / 2**20,
                 self.max_tokens, "; longer prompts stay on this worker" if self.max_tokens < runner.max_model_len
                 else f" (max model length {runner.max_model_len})")
        slab = (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()) if self.cuda else aligned_slab
        self.pool = PinnedPool(buffer_bytes, num_buffers, slab)
        self.pool.slab.fill(0)  # touch every page now, not during the first hand-offs
        self.copy_stream = torch.cuda.Stream(dev) if self.cuda else None
        self.jobs: queue.Queue = queue.Queue(max_jobs)
        self.refusals = refusals or Refusals()
        self.sockets: dict[str, zmq.Socket] = {}
        self.stopping = threading.Event()
        self.thread = worker_thread(self._run, "kv-export", "KV export thread", self.stopping)
        self.thread.start()

    # --- engine thread -------------------------------------------------------

    def submit(self, job: ExportJob) -> None:
        """Queue an export; on CUDA, first mark the compute stream's present point as its start."""
        if self.cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()  # after the step that wrote the sequence's last blocks
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.refusals.add("kv_export", self.jobs.maxsize)
            self.notify(ExportEvent(job.key, "failed", reason=f"{self.jobs.maxsize} exports are queued already"))

    def close(self) -> None:
        self.stopping.set()
        with contextlib.suppress(queue.Full):  # a full queue wakes the thread anyway
            self.jobs.put_nowait(None)
        self.thread.join(timeout=5)

    # --- sender thread -------------------------------------------------------

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.runner.model.device)
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.05)
            except queue.Empty:
                job = None
            self._poll_replies()
            if job is None:
                continue
            try:
                self._export(job)
            except Exception as exc:  # an export that fails leaves the sequence on the GPU worker
                log.warning("KV export of %s failed: %s", job.key[1], exc)
                if self.copy_stream is not None:
                    self.copy_stream.synchronize()  # no copy may still read the blocks
                self.notify(ExportEvent(job.key, "failed", reason=str(exc)))
        for sock in self.sockets.values():
            sock.close(0)

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer: an absent one times out
            sock.setsockopt(zmq.SNDTIMEO, int(self.wait_s * 1e3))
            sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)  # fewer, larger kernel copies (capped by wmem_max)
            if self.transport is not None:
                self.transport.client(sock, endpoint, "hand-off endpoint")
            sock.connect(endpoint)
            self.sockets[endpoint] = sock
        return sock

    def _poll_replies(self) -> None:
        """Refusals the CPU workers sent back on the hand-off socket: to the engine (then the router)."""
        for sock in self.sockets.values():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = wire.decode(frames)
                except ValueError as exc:
                    log.warning("dropping a bad reply on the hand-off socket: %s", exc)
                    continue
                if isinstance(msg, HandoffRefused):
                    self.notify(ExportEvent((b"", msg.request_id), "refused", refused=msg))

    def _export(self, job: ExportJob) -> None:
        h = job.header
        self.pauses.pause("exporting")
        if job.cancelled.is_set():
            self.notify(ExportEvent(job.key, "cancelled"))
            return
        cache, bs = self.runner.cache, self.runner.cache.block_size
        nblk = -(-h.num_tokens // bs)
        parts = self._parts(h.num_tokens, nblk)  # before the header: a hand-off too long fails unheard of
        sock = self._socket(job.endpoint)
        sock.send_multipart(wire.encode(h))
        dev = cache.k[self.layers[0]].device
        if self.copy_stream is None:
            table = torch.tensor(job.block_table[:nblk], dtype=torch.int64)
        else:
            with torch.cuda.stream(self.copy_stream):  # allocated, and so reused, on the copy stream only
                table = torch.tensor(job.block_table[:nblk], dtype=torch.int64).to(dev)
        pending: deque = deque()  # parts copied (or copying), not yet sent
        nbytes, copy_s, hidden_s = 0, 0.0, 0.0
        for layers, frames in parts:
            if job.cancelled.is_set():
                break
            if self.pool.num_free == 0 and pending:
                c, hdn = self._send_part(sock, job, *pending.popleft())
                copy_s, hidden_s = copy_s + c, hidden_s + hdn
            buf = self.pool.acquire(wait_s=self.wait_s)
            try:
                timing = self._copy(buf, layers, frames, table, nblk, job.ready)
            except Exception:
                self.pool.release(buf)
                raise
            pending.append((buf, layers, frames, timing))
            nbytes += sum(sent for _, _, sent in frames)
        while pending:
            if job.cancelled.is_set():
                buf, *_ = pending.popleft()
                self.pool.release(buf, self._copy_done_check())
                continue
            c, hdn = self._send_part(sock, job, *pending.popleft())
            copy_s, hidden_s = copy_s + c, hidden_s + hdn
        if job.cancelled.is_set():
            if self.copy_stream is not None:
                self.copy_stream.synchronize()
            self.notify(ExportEvent(job.key, "cancelled"))
            return
        self.pauses.pause("exported")
        self.notify(ExportEvent(job.key, "sent", nbytes=nbytes, export_s=time.monotonic() - job.started,
                                copy_s=copy_s, hidden_s=hidden_s))

    def _parts(self, num_tokens: int, nblk: int) -> list[tuple[range, list[tuple[int, int, int]]]]:
        """The parts of a hand-off of `num_tokens` (`nblk` blocks): each a range of layers sent and its frames
        in a buffer, K then V per layer, as (byte offset, bytes gathered: whole blocks, bytes sent: the first
        num_tokens rows), packed by bytes since layers' shapes may differ. About PARTS_PER_HANDOFF parts
        (fewer layers to a part when a buffer holds less): the first part's copy and the last part's import
        are what the pipeline cannot overlap.

        Raises:
            ValueError: the largest layer's K and V of `nblk` blocks exceed a buffer.
        """
        slots, limit = nblk * self.runner.cache.block_size, self.pool.buffer_bytes
        if 2 * slots * max(self.rows) > limit:
            raise ValueError(f"a hand-off of {num_tokens} tokens: one layer's K and V ({2 * slots * max(self.rows)} "
                             f"bytes) exceed a pinned buffer ({limit} bytes, up to {self.max_tokens} tokens; "
                             "--handoff-buffer-memory sets them)")
        per_part = max(1, -(-len(self.layers) // PARTS_PER_HANDOFF))
        parts, first = [], 0
        while first < len(self.layers):
            frames, end, used = [], first, 0
            while end < len(self.layers) and end - first < per_part and used + 2 * slots * self.rows[end] <= limit:
                for _ in "KV":
                    frames.append((used, slots * self.rows[end], num_tokens * self.rows[end]))
                    used += slots * self.rows[end]
                end += 1
            parts.append((range(first, end), frames))
            first = end
        return parts

    def _copy_done_check(self):
        if self.copy_stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev.query

    def _gathers(self, buf, layers: range, frames: list[tuple[int, int, int]], nblk: int) -> list:
        """(source, destination) per frame of a part: the cache tensor of the frame's layer, K or V, as
        `[blocks, block_size, kv_heads, head_dim]`, and its place in `buf` as `[nblk, block_size, kv_heads,
        head_dim]`, each in that layer's own shape."""
        cache = self.runner.cache
        bs = cache.block_size
        pairs = []
        for i, (offset, gathered, _) in enumerate(frames):
            src = (cache.k, cache.v)[i % 2][self.layers[layers[i // 2]]]
            kv_shape = src.shape[1:]
            dst = torch.from_numpy(buf.memory[offset : offset + gathered]).view(src.dtype)
            pairs.append((src.view(-1, bs, *kv_shape), dst.view(nblk, bs, *kv_shape)))
        return pairs

    def _copy(self, buf, layers: range, frames: list[tuple[int, int, int]], table: torch.Tensor, nblk: int,
              ready):
        """Gather `layers`' K and V blocks into `buf` at their frames' offsets (`_parts`).

        The CPU path and the CUDA copy-stream path gather the same (source, destination) pairs
        (`_gathers`); only CUDA's waits for `ready` and copies asynchronously. Returns (start, end)
        of the copy: CUDA timing events on the copy stream, or monotonic times on the CPU."""
        pairs = self._gathers(buf, layers, frames, nblk)
        if self.copy_stream is None:
            start = time.monotonic()
            for src, dst in pairs:
                torch.index_select(src, 0, table, out=dst)
            return start, time.monotonic()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)  # the step that wrote the blocks comes first
            start.record(self.copy_stream)
            for src, dst in pairs:
                dst.copy_(src.index_select(0, table), non_blocking=True)  # gathered on the copy stream
            end.record(self.copy_stream)
        return start, end

    def _send_part(self, sock: zmq.Socket, job: ExportJob, buf, layers: range, frames: list[tuple[int, int, int]],
                   timing) -> tuple[float, float]:
        """Wait for the part's copy, send it zero-copy, hand the buffer back; (copy s, hidden s)."""
        start, end = timing
        if self.copy_stream is not None:
            end.synchronize()
            copy_s = start.elapsed_time(end) / 1e3
        else:
            copy_s = end - start
        hidden_s = self.runner.timeline.overlap_s(start, end)
        part = HandoffPart(job.header.request_id, job.header.token, layers[0], len(layers))
        sock.send_multipart(wire.encode(part), zmq.SNDMORE)
        trackers = []
        views = [buf.memory[offset : offset + sent] for offset, _, sent in frames]  # the first num_tokens rows
        for i, view in enumerate(views):
            flags = zmq.SNDMORE if i < len(views) - 1 else 0
            trackers.append(sock.send(view, flags, copy=False, track=True))
        tracker = zmq.MessageTracker(*trackers)
        self.pool.release(buf, lambda: tracker.done)
        return copy_s, min(hidden_s, copy_s)
