"""Every message between routers and workers, as msgspec Structs (never pickle).

The request, output and load messages, and the KV hand-off (gpu->cpu) messages
with their header; see "KV hand-off messages" below for who sends what when.
"""

from __future__ import annotations

import enum

import msgspec

# The request's sampling fields, carried by AddRequest and HandoffHeader: imported from here by the rest.
from hybridgate.sampling_params import (CONSTRAINT_KINDS, MAX_LOGPROBS, MAX_SEED, MAX_STOP_BYTES,  # noqa: F401
                                        MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Constraint, InvalidFieldError,
                                        SamplingParams)

ROPE_BASIS = "gguf-adjacent-pairs"  # HandoffHeader.rope_basis: RoPE on (x[2i], x[2i+1]) in GGUF's row order
HANDOFF_DTYPES = ("float32", "bfloat16", "float16")  # HandoffHeader.dtype


class FinishReason(enum.IntEnum):
    """Why a sequence ended; the values match the proto's FinishReason."""

    STOP = 1
    LENGTH = 2
    EOS = 3
    ABORT = 4


class PoolingType(enum.IntEnum):
    """How an embedding request's final hidden states become one vector: llama.cpp's `llama_pooling_type`
    numbers, as GGUF stores them in `<arch>.pooling_type` (gguf-py's `PoolingType`; RANK, 4, is not served).

    NONE on an `AddRequest` means a generation. MEAN: the average over the prompt's tokens; CLS: the first
    token's; LAST: the last token's (decoder embedding models such as Qwen3-Embedding). Each is the hidden
    state after the model's final norm, unnormalised (the router normalises).
    """

    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3


class WorkerState(enum.IntEnum):
    """A worker as a router sees it (transitions: `hybridgate.clients.lifecycle.Lifecycle`)."""

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
    # KV hand-off (gpu->cpu); see "KV hand-off messages" below.
    HANDOFF_RESERVE = b"r"  # router → CPU worker: reserve blocks for a hand-off
    HANDOFF_RESERVATION = b"s"  # CPU worker → router: the reservation (with its token) or a refusal
    HANDOFF_EXPORTED = b"e"  # GPU worker → router: the KV was sent; the sequence is parked
    HANDOFF_EXPORT_FAILED = b"f"  # GPU worker → router: no export; the GPU worker decodes on
    HANDOFF_IMPORTED = b"i"  # CPU worker → router: the KV was imported; it decodes from here on
    HANDOFF_REFUSED = b"n"  # CPU worker → router: a hand-off for this router's reservation was refused
    HANDOFF_RELEASE = b"l"  # router → GPU worker: the import is confirmed; free the parked sequence
    HANDOFF_RESUME = b"u"  # router → GPU worker: the CPU side failed; decode the parked sequence here
    HANDOFF_KV = b"K"  # GPU worker → CPU worker's hand-off socket: the header
    HANDOFF_KV_PART = b"P"  # GPU worker → CPU worker's hand-off socket: whole layers' K and V frames


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
    cpu_isa: str = ""  # CPU workers: the instruction set of their kernels (avx512, avx2, generic)
    kv_dtype: str = ""  # the KV cache's element type, one of HANDOFF_DTYPES ("" = not reported)
    model: str = ""  # the served model's name (serve's NAME of --model NAME=PATH, else the GGUF's name)


class Ready(msgspec.Struct, frozen=True):
    kind: str


class HandoffTarget(msgspec.Struct, frozen=True):
    """Where a GPU worker sends a request's KV after its first token (set on `AddRequest.handoff`).

    endpoint: the CPU worker's hand-off socket (its HELLO's `handoff_endpoint`);
    token: the CPU worker's reservation token for this request
    (`HandoffReservation.token`), copied into the header so the CPU worker
    can match the KV to its reservation.
    """

    endpoint: str
    token: str


class AddRequest(msgspec.Struct, frozen=True):
    """A request as the worker needs it: resolved seed and max_tokens, ids only.

    handoff: a `gpu->cpu` request on the GPU worker: prefill, sample and stream
    token 0 as usual, then export the KV to `handoff.endpoint` and park the
    sequence (see "KV hand-off messages"). None: an ordinary request.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_id: int
    # A resumed stream: prompt_ids end with the ids already streamed, and sampling
    # and outputs continue at this token index (DESIGN.md, Worker lifecycle).
    first_token_index: int = 0
    handoff: HandoffTarget | None = None
    # Seconds the request may wait on the worker for its first step, from its arrival there; 0: no limit.
    # One that waits longer is dropped unrun, answered with ERROR_DEADLINE_EXCEEDED.
    deadline_s: float = 0.0
    # A PoolingType: NONE, a generation; otherwise an embedding request, prefill only (no token sampled): the
    # worker answers one SeqOutput with finish STOP, no ids, and the pooled hidden state in `embedding`.
    pooling: int = 0


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
    queue_refusals: dict[str, int] = msgspec.field(default_factory=dict)  # queue → messages refused at its bound
    # KV hand-off (gpu->cpu). Counters are cumulative; "handoff_" gauges are now.
    handoff_bytes_total: int = 0  # K and V bytes exported (GPU worker) or imported (CPU worker)
    handoff_export_seconds_total: float = 0.0  # GPU worker: export start to the send queued, summed
    handoff_copy_seconds_total: float = 0.0  # GPU worker: gather copies of the cache into pinned buffers
    handoff_copy_hidden_seconds_total: float = 0.0  # the part of those copies that ran while a step was in flight
    handoff_import_seconds_total: float = 0.0  # CPU worker: header received to the sequence scheduled
    handoff_outcomes: dict[str, int] = msgspec.field(default_factory=dict)  # outcome → count (see HandoffOutcome)
    handoff_pool_waits: int = 0  # exports that waited for a free pinned buffer
    handoff_pool_bytes_in_use: int = 0  # pinned hand-off buffers held now
    handoff_pool_peak_bytes: int = 0
    handoff_parked: int = 0  # GPU worker: sequences exported and parked now
    handoff_reservations: int = 0  # CPU worker: live reservations now
    handoff_recomputed: int = 0  # CPU worker: imported sequences preempted and recomputed
    handoff_replies_lost: int = 0  # CPU worker: refusals to hand-off senders that could not be sent
    # Load report for placement (hybridgate/router/costmodel.py); gauges, now.
    queued_prefill_tokens: int = 0  # prompt tokens not yet computed: waiting sequences and prefills in progress
    decoding: int = 0  # running sequences past their prompt: one token each per step
    blocks_cached: int = 0  # free blocks that still hold a cached prefix (evicted on demand)
    # Blocks held now plus those its sequences still need to reach max_tokens (a hand-off's: its first
    # token): what the cache is promised; above blocks_total, running sequences will be preempted.
    blocks_committed: int = 0
    max_num_seqs: int = 0  # the scheduler's batch cap
    max_num_batched_tokens: int = 0  # the scheduler's token budget per step
    # Measured rates, moving medians over recent steps, seeded by a warm-up measurement at start
    # (hybridgate/workers/rates.py): tokens in a step with a prompt chunk (power-of-two bucket) →
    # tokens/s of that step; sequences in a decode-only step (exact up to 8, then power-of-two
    # buckets) → seconds per step.
    prefill_tokens_per_s: dict[int, float] = msgspec.field(default_factory=dict)
    decode_step_s: dict[int, float] = msgspec.field(default_factory=dict)
    # Constraints (hybridgate/workers/constraints.py). Counters are cumulative; gauges are now.
    constrained_requests: int = 0  # constrained sequences admitted (counter)
    constrained_running: int = 0  # gauge: constrained sequences scheduled (waiting or running)
    waiting_for_grammar: int = 0  # gauge: sequences whose grammar is compiling
    grammar_compiles: int = 0  # grammars compiled (grammar cache misses)
    grammar_compile_errors: int = 0  # grammars refused
    grammar_compile_seconds_total: float = 0.0
    grammar_cache_hits: int = 0  # constrained sequences whose grammar was compiled (or compiling) already
    mask_fills: int = 0  # sequence-steps whose token bitmask was filled
    mask_fill_seconds_total: float = 0.0  # summed over sequence-steps (on a thread beside the forward pass)
    mask_wait_seconds_total: float = 0.0  # time sampling waited for a fill after the forward pass


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sampled id's raw log-probability (natural log) and the most likely ids with theirs, most likely first."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


# Untracked by the cycle collector (gc=False): one is decoded per sequence and step, and its fields hold
# ids, numbers and bytes, never a cycle.
class SeqOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    token_index: int  # index of token_ids[0] among the generated tokens
    token_ids: list[int]
    finish: int = 0  # 0 or a FinishReason
    queue_ms: float = 0.0  # set with the first token: arrival to first scheduled step
    cached_tokens: int = 0
    # One per id of token_ids when the request asked for logprobs (SamplingParams.logprobs), else empty.
    logprobs: list[TokenLogprobs] = []
    # An embedding request's answer (AddRequest.pooling): float32 little-endian `[hidden]`, pooled after the
    # final norm, not normalised; empty for a generation.
    embedding: bytes = b""

    def tail(self, skip: int, token_index: int) -> SeqOutput:
        """This output less its first `skip` ids (and their logprobs), numbered from `token_index`."""
        return msgspec.structs.replace(self, token_index=token_index, token_ids=self.token_ids[skip:],
                                       logprobs=self.logprobs[skip:])


class Outputs(msgspec.Struct, frozen=True):
    outputs: list[SeqOutput]
    stats: EngineStats


class Load(msgspec.Struct, frozen=True):
    stats: EngineStats


# RequestError codes: what the router does with a failed request.
ERROR_INTERNAL = "internal"  # the worker failed it (gRPC INTERNAL)
ERROR_RESOURCE_EXHAUSTED = "resource_exhausted"  # device or host memory ran out for it (RESOURCE_EXHAUSTED)
ERROR_NO_KV_BLOCKS = "no_kv_blocks"  # it needs more KV blocks than this worker's cache holds: place it elsewhere
ERROR_QUEUE_FULL = "queue_full"  # the worker's waiting queue is at --max-num-waiting: place it elsewhere
ERROR_DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline passed while it waited, before any work (DEADLINE_EXCEEDED)
ERROR_INVALID_REQUEST = "invalid_request"  # the ADD failed the worker's checks (a router bug: INTERNAL)
# Its constraint's grammar does not compile, or does not accept the ids already generated (INVALID_ARGUMENT
# naming the field `constraint`), answered before any token.
ERROR_INVALID_CONSTRAINT = "invalid_constraint"


class RequestError(msgspec.Struct, frozen=True):
    request_id: str
    message: str
    # ERROR_INTERNAL, or ERROR_NO_KV_BLOCKS / ERROR_RESOURCE_EXHAUSTED / ERROR_QUEUE_FULL: a refusal another worker may not
    # give, so the router places the request elsewhere before it fails. Unknown codes read as internal.
    code: str = ERROR_INTERNAL


class Overload(msgspec.Struct, frozen=True):
    """The worker could not send to this router (its queue was full); it dropped these requests."""

    request_ids: list[str]
    reason: str


# --- KV hand-off messages ------------------------------------------------------
#
# One gpu->cpu request, with the router as the owner of its state (the state
# machine lives in hybridgate.router; this is what each worker does):
#
#  1. router → CPU worker (request socket): HandoffReserve(request_id, num_tokens).
#     The CPU worker allocates blocks for num_tokens (prompt + 1) slots and holds
#     them, unscheduled, and answers HandoffReservation(ok=True, token=...), or
#     ok=False with a reason (no blocks, not ready, a duplicate id, hand-off off).
#     A reservation expires after the CPU worker's reservation timeout and on
#     Abort(request_id) from the router that made it.
#  2. router → GPU worker: AddRequest(..., handoff=HandoffTarget(endpoint, token)).
#     The GPU worker prefills, samples and streams token 0 as usual (Outputs),
#     then exports: gathers the sequence's K and V into pinned buffers and sends
#     one HANDOFF_KV message to the CPU worker's hand-off socket (a DEALER it
#     connects on first use), and parks the sequence (blocks held, not
#     scheduled). It tells the router HandoffExported once the send is queued,
#     or HandoffExportFailed when there was nothing to export (the stream
#     finished with token 0) or the export could not start; then it decodes on
#     itself, as an ordinary request.
#  3. GPU worker → CPU worker (hand-off socket): [HANDOFF_KV, HandoffHeader], then
#     parts in layer order [HANDOFF_KV_PART, HandoffPart, K layer i, V layer i,
#     K layer i + 1, ...], each K or V frame `[num_tokens, kv_heads, head_dim]`
#     of `dtype`, C order (parts are sized by the sender's pinned buffers, so a
#     hand-off larger than its slab streams through it). A refusal also goes
#     back to the sender on that socket (the GPU worker forwards it to its
#     router, which resumes the parked sequence).
#     The CPU worker checks the header against its own model and its live
#     reservation; on success it imports the KV into the reserved blocks and
#     answers the router that made the reservation HandoffImported (its outputs
#     for the request go to that router from then on, starting at
#     `next_token_index`); otherwise HandoffRefused naming the field and both
#     values (the reservation is freed, except for a wrong token, which never
#     spends it). A hand-off without a live reservation is dropped and counted.
#  4. router → GPU worker: HandoffRelease(request_id) after HandoffImported (free
#     the parked sequence), or HandoffResume(request_id) after HandoffRefused or
#     a lost CPU worker (decode the parked sequence on the GPU from where it
#     stopped: no token lost or repeated).
#  Abort(request_ids) goes to both workers at any point and is idempotent: it
#  frees parked sequences, reservations and imported sequences alike.


class HandoffOutcome(str, enum.Enum):
    """Keys of `EngineStats.handoff_outcomes` (and the `outcome` label of kv_handoff_total)."""

    DONE = "done"  # GPU: released after import; CPU: imported
    REFUSED = "refused"  # CPU: header refused; GPU: export failed
    ABORTED = "aborted"  # parked sequence or reservation aborted
    RESUMED = "resumed"  # GPU: parked sequence resumed on the GPU
    EXPIRED = "expired"  # CPU: reservation timed out
    DROPPED = "dropped"  # CPU: a hand-off with no live reservation for its request id


class HandoffReserve(msgspec.Struct, frozen=True):
    """router → CPU worker: hold blocks for `num_tokens` KV slots (prompt + 1) of this request."""

    request_id: str
    num_tokens: int


class HandoffReservation(msgspec.Struct, frozen=True):
    """CPU worker → router: the answer to HandoffReserve.

    ok: blocks are held for the request; token: the secret a hand-off header
    must carry (hex, from `secrets`). Not ok: reason says why (no blocks, not
    ready, a duplicate request id, too long).
    """

    request_id: str
    ok: bool
    token: str = ""
    reason: str = ""


class HandoffHeader(msgspec.Struct, frozen=True, kw_only=True):
    """The first body frame of a HANDOFF_KV message (GPU worker → CPU worker).

    Shapes of the frames that follow: 2 * num_layers frames, K then V per layer
    sent (those that own K/V, `ModelConfig.kv_layers`, in order: num_layers and
    `HandoffPart.first_layer` count these), each `[num_tokens, num_kv_heads,
    head_dim]`, or `[num_tokens, *layer_shapes[j]]` for sent layer j where
    layer_shapes is not empty (num_kv_heads and head_dim are then 0), of `dtype`
    ("float32", "bfloat16" or "float16"; bfloat16 as raw uint16 words), C order. Keys are
    in `rope_basis` ("gguf-adjacent-pairs": RoPE on (x[2i], x[2i+1]) in GGUF's
    row order). num_tokens: KV slots sent (the tokens computed: the prompt, and
    for a resumed stream the ids it carries), = len(prompt_ids) +
    len(output_ids) - 1. output_ids: ids sampled by the sender (the first at
    token index `next_token_index - len(output_ids)`), already streamed to the
    router; the receiver samples the id of `next_token_index` next.
    """

    request_id: str
    token: str  # the CPU worker's reservation token (HandoffTarget.token)
    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    rope_basis: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_id: int
    next_token_index: int
    layer_shapes: list[tuple[int, int]] = []  # (KV heads, head dim) per layer sent where they differ (gemma4)


class HandoffPart(msgspec.Struct, frozen=True):
    """GPU worker → CPU worker: sent layers first_layer .. first_layer + num_layers - 1 of a
    hand-off (2 * num_layers frames follow: K then V per layer)."""

    request_id: str
    token: str
    first_layer: int
    num_layers: int


class HandoffExported(msgspec.Struct, frozen=True):
    """GPU worker → router: the KV of `request_id` was sent; the sequence is parked until
    HandoffRelease, HandoffResume or Abort. nbytes: K and V bytes; export_ms: export start
    to the send queued; copy_ms: gather copies into the pinned buffers."""

    request_id: str
    nbytes: int
    export_ms: float
    copy_ms: float = 0.0


class HandoffExportFailed(msgspec.Struct, frozen=True):
    """GPU worker → router: no KV was sent for `request_id`; the GPU worker goes on
    decoding it (or it finished with token 0: reason "finished"). The router frees the
    CPU worker's reservation."""

    request_id: str
    reason: str


class HandoffImported(msgspec.Struct, frozen=True):
    """CPU worker → router (the one that reserved): the KV is imported; outputs of
    `request_id` come from this worker from `next_token_index` on."""

    request_id: str
    next_token_index: int
    import_ms: float = 0.0  # header received to imported (includes waiting for the parts)
    write_ms: float = 0.0  # of which converting and writing the KV into the cache


class HandoffRefused(msgspec.Struct, frozen=True):
    """CPU worker → router (the one that reserved): the hand-off of `request_id` was refused.

    field: the header field (or "frames", "token", "blocks") that did not match;
    message: both values. The router resumes the parked sequence on the GPU worker.
    """

    request_id: str
    field: str
    message: str


class HandoffRelease(msgspec.Struct, frozen=True):
    """router → GPU worker: the import is confirmed; free the parked sequence and its buffers."""

    request_id: str


class HandoffResume(msgspec.Struct, frozen=True):
    """router → GPU worker: the CPU side refused or died; decode the parked sequence on
    the GPU from where it stopped (its next token index is unchanged)."""

    request_id: str


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
    MsgType.HANDOFF_RESERVE: HandoffReserve,
    MsgType.HANDOFF_RESERVATION: HandoffReservation,
    MsgType.HANDOFF_EXPORTED: HandoffExported,
    MsgType.HANDOFF_EXPORT_FAILED: HandoffExportFailed,
    MsgType.HANDOFF_IMPORTED: HandoffImported,
    MsgType.HANDOFF_REFUSED: HandoffRefused,
    MsgType.HANDOFF_RELEASE: HandoffRelease,
    MsgType.HANDOFF_RESUME: HandoffResume,
    MsgType.HANDOFF_KV: HandoffHeader,
    MsgType.HANDOFF_KV_PART: HandoffPart,
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
