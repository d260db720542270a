"""A request's sampling parameters and their limits (DESIGN.md, Sampling): the fields every router and
worker checks, carried on the wire (`hybridgate.wire` re-exports them)."""

from __future__ import annotations

import math

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_SEED = 2**64 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit; vLLM's default max_logprobs)


class InvalidFieldError(ValueError):
    """A request field is outside its limit; `field` names it (gRPC: INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tools")  # Constraint.kind


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """A structured-output constraint, normalized at the edge into one llguidance grammar.

    kind: what the request asked for, one of CONSTRAINT_KINDS (metrics and errors name it).
    grammar: the llguidance grammar the worker compiles (Lark syntax, JSON schemas inlined
    with `%json { ... }`; llguidance's docs/syntax.md); equal texts are the same constraint,
    so compiled grammars are cached by a hash of this text.
    """

    kind: str
    grammar: str


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token (DESIGN.md, Sampling; defaults as vLLM and OpenAI).

    temperature: 0 means greedy (argmax); applied after the repetition penalty.
    top_k: 0 or -1 means off. top_p: in (0, 1]. repetition_penalty: > 0, 1 is
    off; seen tokens are the prompt's and the generated ones (as transformers
    and vLLM). seed: None lets the router pick one. max_tokens: None means the
    rest of the context (capped by the router). skip_special_tokens: leave
    special tokens such as `<|im_end|>` out of the streamed text (the router's
    detokenizer; their ids are streamed all the same).
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's penalties over the
    generated ids (the sampler's spec says how). min_p: in [0, 1], 0 is off.
    stop_token_ids: ids that end generation like EOS (finish reason stop; the
    id is streamed, its text shown unless it is a skipped special token, as
    vLLM). min_tokens: EOS and the stop token ids are masked out (step 0 of the
    sampler's spec) until the request has generated this many ids, as vLLM's
    `min_tokens`; at most max_tokens. logprobs: None asks for none; k in [0, 20]: each sampled id's raw
    log-probability and the k most likely ids with theirs. constraint: None, or
    the grammar every sampled token must keep satisfiable (EOS only where it accepts).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None
    min_tokens: int = 0

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                raise InvalidFieldError(name, f"must be in [-2, 2], got {value}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidFieldError("min_p", f"must be in [0, 1], got {self.min_p}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise InvalidFieldError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, each >= 0, got "
                                    f"{list(self.stop_token_ids)[:MAX_STOP_TOKEN_IDS + 1]}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidFieldError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidFieldError("seed", f"must be in [0, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidFieldError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidFieldError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidFieldError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                    f"got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidFieldError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s.encode("utf-8")) > MAX_STOP_BYTES:
                raise InvalidFieldError("stop", f"each string must be 1 to {MAX_STOP_BYTES} bytes, got {len(s.encode())}")
        return self
