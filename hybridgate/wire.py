"""Every message between routers and workers, as msgspec Structs (never pickle).

This issue defines only the sampling parameters; the request, output and
hand-off messages join them here.
"""

from __future__ import annotations

import math

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_SEED = 2**64 - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token (DESIGN.md, Sampling; defaults as vLLM and OpenAI).

    temperature: 0 means greedy (argmax); applied after the repetition penalty.
    top_k: 0 or -1 means off. top_p: in (0, 1]. repetition_penalty: > 0, 1 is
    off; seen tokens are the prompt's and the generated ones (as transformers
    and vLLM). seed: None lets the router pick one. max_tokens: None means the
    rest of the context (capped by the router).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        """Return self if every field is within its limit.

        Raises:
            ValueError: naming the field and its limit.
        """
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (-1 or 0 turn it off), got {self.top_k}")
        if math.isnan(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s.encode("utf-8")) > MAX_STOP_BYTES:
                raise ValueError(f"stop: each string must be 1 to {MAX_STOP_BYTES} bytes, got {len(s.encode())}")
        return self
