"""llama.cpp on the same GGUF, threads and prompts: the CPU worker's baseline.

Uses llama-cpp-python's low-level API (the `bench` extra): one context with
`n_seq_max` parallel sequences, and `llama_decode` on batches that hold one
token of every running sequence per decode step (llama.cpp's own batched
decoding, as in its `batched` example), greedy by argmax of the returned
logits. Prefill: the prompt in one batch of `n_batch` tokens, logits of the
last one only.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np


class LlamaCppBaseline:
    """llama.cpp context on `path` with `threads` threads and room for `max_seqs` sequences."""

    def __init__(self, path: Path, threads: int, max_seqs: int = 16, n_ctx: int = 4096):
        try:
            import llama_cpp
        except ImportError as exc:  # pragma: no cover - the extra is optional
            raise RuntimeError("--baseline llama-cpp needs the bench extra: pip install -e '.[bench]'") from exc
        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        lib.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # ggml's AMX buffer type segfaults in ggml_backend_amx_mul_mat on batches of more than one token on
        # these machines (llama-cpp-python 0.3.36); the extra buffer types are off, the AVX-512 kernels run.
        mparams.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(os.fsencode(path), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one cache shared by the sequences, as our paged cache is
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.max_seqs = max_seqs
        self.batch = lib.llama_batch_init(512, 0, max_seqs)
        self.threads = threads

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _prefill(self, prompt: list[int], seq: int) -> int:
        for start in range(0, len(prompt), 512):
            chunk = prompt[start : start + 512]
            self._decode([(t, start + j, seq, start + j == len(prompt) - 1) for j, t in enumerate(chunk)])
        return self._argmax(len(prompt) - 1 - (len(prompt) - 1) // 512 * 512)

    def decode(self, batch: list[list[int]], new_tokens: int) -> float:
        """Tokens/s of len(batch) parallel greedy sequences, `new_tokens` each (prefill included)."""
        if len(batch) > self.max_seqs:
            raise ValueError(f"concurrency {len(batch)} exceeds the baseline's n_seq_max {self.max_seqs}")
        self._clear()
        start = time.perf_counter()
        last = [self._prefill(p, s) for s, p in enumerate(batch)]
        for step in range(new_tokens - 1):
            self._decode([(tok, len(p) + step, s, True) for s, (tok, p) in enumerate(zip(last, batch))])
            last = [self._argmax(i) for i in range(len(batch))]
        return len(batch) * new_tokens / (time.perf_counter() - start)

    def decode_step_ms(self, prompt: list[int], steps: int = 64) -> float:
        """Median wall time of one decode step of one sequence (logits to argmax included)."""
        self._clear()
        tok = self._prefill(prompt, 0)
        times = []
        for step in range(steps):
            start = time.perf_counter()
            self._decode([(tok, len(prompt) + step, 0, True)])
            tok = self._argmax(0)
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e3

    def prefill(self, batch: list[list[int]]) -> float:
        """Tokens/s of prefilling each prompt in turn (one token out each)."""
        self._clear()
        start = time.perf_counter()
        for s, p in enumerate(batch):
            self._prefill(p, s % self.max_seqs)
            self._clear()
        return sum(len(p) for p in batch) / (time.perf_counter() - start)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level, text, user_data):  # pragma: no cover - called from C
    return None
