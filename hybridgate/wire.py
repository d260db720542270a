"""Every message between routers and workers, as msgspec Structs (never pickle).

This issue defines only the sampling parameters; the request, output and
hand-off messages join them here.
"""

from __future__ import annotations

import enum
import math

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_SEED = 2**64 - 1


class InvalidFieldError(ValueError):
    """A request field is outside its limit; `field` names it (gRPC: INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token (DESIGN.md, Sampling; defaults as vLLM and OpenAI).

    temperature: 0 means greedy (argmax); applied after the repetition penalty.
    top_k: 0 or -1 means off. top_p: in (0, 1]. repetition_penalty: > 0, 1 is
    off; seen tokens are the prompt's and the generated ones (as transformers
    and vLLM). seed: None lets the router pick one. max_tokens: None means the
    rest of the context (capped by the router). skip_special_tokens: leave
    special tokens such as `<|im_end|>` out of the streamed text (the router's
    detokenizer; their ids are streamed all the same).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> SamplingParams:
        """Return self if every field is within its limit.

        Raises:
            InvalidFieldError: naming the field and its limit.
        """
        if math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidFieldError("temperature", f"must be >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidFieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidFieldError("top_k", f"must be >= -1 (-1 or 0 turn it off), got {self.top_k}")
        if math.isnan(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidFieldError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidFieldError("seed", f"must be in [0, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidFieldError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidFieldError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s.encode("utf-8")) > MAX_STOP_BYTES:
                raise InvalidFieldError("stop", f"each string must be 1 to {MAX_STOP_BYTES} bytes, got {len(s.encode())}")
        return self


class FinishReason(enum.IntEnum):
    """Why a sequence ended; the values match the proto's FinishReason."""

    STOP = 1
    LENGTH = 2
    EOS = 3
    ABORT = 4


class WorkerState(enum.IntEnum):
    """A worker as a router sees it (transitions: `hybridgate.router.lifecycle.Lifecycle`)."""

    CONNECTING = 0  # CONNECT sent (resent on a backoff) until HELLO, then READY after warm-up
    READY = 1  # placed on
    DEAD = 2  # silent past the liveness timeout: its streams were failed or moved
    REFUSED = 3  # serves another model (terminal)
    SUSPECT = 4  # silent for a while, or a send failed: not placed on, aborts still sent
    PROBING = 5  # after DEAD: CONNECT resent on a capped backoff until the worker answers


class MsgType(bytes, enum.Enum):
    """First frame of every message: one byte, dispatched before decoding."""

    CONNECT = b"C"  # router → worker: a router (its DEALER identity) wants HELLO
    HELLO = b"H"  # worker → router: kind, fingerprint, capacity
    READY = b"R"  # worker → router: warm-up done
    ADD = b"A"  # router → worker: a new request, in full
    ABORT = b"X"  # router → worker: stop these requests (fast path)
    OUTPUTS = b"O"  # worker → router: one step's new tokens for this router's sequences
    LOAD = b"L"  # worker → router: heartbeat with load and engine counters
    ERROR = b"E"  # worker → router: a request failed in the worker
    OVERLOAD = b"V"  # worker → router: it could not send to this router; these requests were dropped


class Connect(msgspec.Struct, frozen=True):
    router_id: str


class Hello(msgspec.Struct, frozen=True):
    kind: str  # "gpu" or "cpu"
    fingerprint: str
    max_num_seqs: int
    max_model_len: int
    pid: int
    ready: bool
    boot_id: str = ""  # new on every worker start: a new boot id is a new worker, its old sequences gone
    name: str = ""  # stable label (`kind-index` under serve, or --worker-name); metrics use it
    handoff_endpoint: str = ""  # CPU workers: where GPU workers send KV hand-offs ("" = none)


class Ready(msgspec.Struct, frozen=True):
    kind: str


class AddRequest(msgspec.Struct, frozen=True):
    """A request as the worker needs it: resolved seed and max_tokens, ids only."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_id: int
    # A resumed stream: prompt_ids end with the ids already streamed, and sampling
    # and outputs continue at this token index (DESIGN.md, Worker lifecycle).
    first_token_index: int = 0


class Abort(msgspec.Struct, frozen=True):
    request_ids: list[str]


class EngineStats(msgspec.Struct):
    """Engine counters since start (cumulative) and gauges (now)."""

    steps: int = 0
    batch_size_counts: dict[int, int] = msgspec.field(default_factory=dict)  # sequences per step → steps
    tokens_after_abort: int = 0
    kv_cache_bytes: int = 0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens run (prefix-cache hits excluded, recomputation included)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    blocks_used: int = 0
    blocks_total: int = 0
    pinned_bytes_in_use: int = 0
    pinned_peak_bytes: int = 0
    pinned_fallbacks: int = 0
    kernel_cache_hits: int = 0  # CPU runner: compiled kernels loaded from NUMBA_CACHE_DIR
    kernel_cache_misses: int = 0  # CPU runner: kernels compiled because the cache lacked them
    # Messages the worker dropped or refused as malformed or inconsistent (bad frames, unknown
    # types, oversized bodies, ADDs that fail validation, duplicate ADDs); cumulative.
    wire_decode_errors: int = 0


class SeqOutput(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_index: int  # index of token_ids[0] among the generated tokens
    token_ids: list[int]
    finish: int = 0  # 0 or a FinishReason
    queue_ms: float = 0.0  # set with the first token: arrival to first scheduled step
    cached_tokens: int = 0


class Outputs(msgspec.Struct, frozen=True):
    outputs: list[SeqOutput]
    stats: EngineStats


class Load(msgspec.Struct, frozen=True):
    stats: EngineStats


# RequestError codes: what the router does with a failed request.
ERROR_INTERNAL = "internal"  # the worker failed it (gRPC INTERNAL)
ERROR_RESOURCE_EXHAUSTED = "resource_exhausted"  # device or host memory ran out for it (RESOURCE_EXHAUSTED)
ERROR_NO_KV_BLOCKS = "no_kv_blocks"  # it needs more KV blocks than this worker's cache holds: place it elsewhere
ERROR_INVALID_REQUEST = "invalid_request"  # the ADD failed the worker's checks (a router bug: INTERNAL)


class RequestError(msgspec.Struct, frozen=True):
    request_id: str
    message: str
    # ERROR_INTERNAL, or ERROR_NO_KV_BLOCKS / ERROR_RESOURCE_EXHAUSTED: a refusal another worker may not
    # give, so the router places the request elsewhere before it fails. Unknown codes read as internal.
    code: str = ERROR_INTERNAL


class Overload(msgspec.Struct, frozen=True):
    """The worker could not send to this router (its queue was full); it dropped these requests."""

    request_ids: list[str]
    reason: str


MESSAGE_TYPES: dict[MsgType, type] = {
    MsgType.CONNECT: Connect,
    MsgType.HELLO: Hello,
    MsgType.READY: Ready,
    MsgType.ADD: AddRequest,
    MsgType.ABORT: Abort,
    MsgType.OUTPUTS: Outputs,
    MsgType.LOAD: Load,
    MsgType.ERROR: RequestError,
    MsgType.OVERLOAD: Overload,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_TYPES.items()}
_TYPE_OF = {cls: t for t, cls in MESSAGE_TYPES.items()}


def encode(msg: msgspec.Struct) -> list[bytes]:
    """Frames of a message: its one-byte type, then its msgpack body."""
    return [_TYPE_OF[type(msg)].value, _ENCODER.encode(msg)]


def decode(frames: list[bytes]) -> msgspec.Struct:
    """The typed message of `frames` (type byte, body).

    Raises:
        ValueError: unknown type byte or a body that does not match its type.
    """
    if len(frames) < 2:
        raise ValueError(f"a message needs a type frame and a body, got {len(frames)} frames")
    try:
        kind = MsgType(bytes(frames[0]))
    except ValueError:
        raise ValueError(f"unknown message type {bytes(frames[0])!r}") from None
    try:
        return _DECODERS[kind].decode(frames[1])
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad {kind.name} message: {exc}") from exc
