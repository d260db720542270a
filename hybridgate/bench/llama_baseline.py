"""llama.cpp on the same GGUF, threads and prompts: the CPU worker's baseline, in its own process.

Uses llama-cpp-python's low-level API (the `bench` extra): one context with
`n_seq_max` parallel sequences, and `llama_decode` on batches that hold one
token of every running sequence per decode step (llama.cpp's own batched
decoding, as in its `batched` example), greedy by argmax of the returned
logits. Prefill: the prompt in one batch of `n_batch` tokens, logits of the
last one only.

Two configurations: `defaults` (the library's model defaults: extra buffer
types on, so ggml repacks weights for its fastest kernels, as users get it)
and `plain` (`use_extra_bufts` off). Each runs in a child process
(`LlamaCppProcess`: `python -m hybridgate.bench.llama_baseline`, one JSON
request and one JSON answer per line), so a crash inside ggml ends that
baseline, not the benchmark; the child may import llama_cpp from another
build's folder (`--llama-cpp-path`, e.g. one built for AVX2 only) and reports
which build it loaded.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridgate.run.children import end_stdin_child

CONFIGS = {"defaults": True, "plain": False}  # name -> use_extra_bufts


class LlamaCppBaseline:
    """llama.cpp context on `path` with `threads` threads and room for `max_seqs` sequences."""

    def __init__(self, path: Path, threads: int, max_seqs: int = 16, n_ctx: int = 4096, extra_bufts: bool = False):
        try:
            import llama_cpp
        except ImportError as exc:  # pragma: no cover - the extra is optional
            raise RuntimeError(f"--baseline llama-cpp could not import llama_cpp ({exc}): it needs the bench extra, "
                               "pip install -e '.[bench]' (a --llama-cpp-path build installed with --no-deps "
                               "takes its dependencies from there)") from exc
        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        lib.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # On: ggml's extra buffer types (CPU weight repacking, AMX where built) as the library's default.
        mparams.use_extra_bufts = extra_bufts
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

    def teacher_forced_logits(self, cases: list[dict]) -> np.ndarray:
        """float64 `[cases * ids, vocab]`, case-major: the logits predicting each of a case's committed
        ids, stepped as `accuracy.teacher_forced_logits` steps the runners (every prompt in one batch,
        then one token of every case per decode step), so llama.cpp's figures against the fp32
        reference sit beside theirs."""
        if len(cases) > self.max_seqs or sum(len(c["prompt_ids"]) for c in cases) > 512:
            raise ValueError(f"{len(cases)} cases: more than n_seq_max {self.max_seqs} or 512 prompt tokens")
        self._clear()
        entries, last = [], []
        for s, case in enumerate(cases):
            p = case["prompt_ids"]
            entries += [(t, j, s, j == len(p) - 1) for j, t in enumerate(p)]
            last.append(len(entries) - 1)
        steps = len(cases[0]["ids"])
        out = np.empty((len(cases), steps, self.n_vocab), dtype=np.float64)
        for k in range(steps):
            self._decode(entries)
            for s, i in enumerate(last):
                out[s, k] = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            entries = [(c["ids"][k], len(c["prompt_ids"]) + k, s, True) for s, c in enumerate(cases)]
            last = list(range(len(cases)))
        return out.reshape(len(cases) * steps, self.n_vocab)

    def save_teacher_forced_logits(self, cases: list[dict], path: str) -> str:
        """`teacher_forced_logits` written to `path` as float32 `.npy` (llama.cpp's own dtype): the child's
        answer to a parent that cannot take them as one JSON line."""
        np.save(path, self.teacher_forced_logits(cases).astype(np.float32))
        return path

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


    def build(self) -> dict:
        """Which llama.cpp this is: version, library folder and ggml's CPU feature line."""
        info = self.lib.llama_print_system_info()
        return {"version": getattr(self.lib, "__version__", "?"), "path": str(Path(self.lib.__file__).parent),
                "system_info": info.decode() if isinstance(info, bytes) else str(info)}


class LlamaCppProcess:
    """A `LlamaCppBaseline` in a child process: the same methods, answered over a pipe.

    llama_cpp_path: a folder put first on the child's sys.path (another llama-cpp-python build),
    or None for the installed one. `crashed` holds the child's last words once it died; every
    later call raises RuntimeError.
    """

    def __init__(self, path: Path, threads: int, max_seqs: int, config: str, llama_cpp_path: str | None = None,
                 timeout_s: float = 600.0):
        if config not in CONFIGS:
            raise ValueError(f"llama.cpp config: expected one of {', '.join(CONFIGS)}, got {config!r}")
        env = dict(os.environ)
        if llama_cpp_path:
            env["PYTHONPATH"] = os.pathsep.join([llama_cpp_path, *filter(None, [env.get("PYTHONPATH")])])
        self.config, self.timeout_s, self.crashed = config, timeout_s, ""
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridgate.bench.llama_baseline"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.info = self._call("init", path=str(path), threads=threads, max_seqs=max_seqs,
                               extra_bufts=CONFIGS[config])

    def _call(self, op: str, **kw):
        if self.crashed:
            raise RuntimeError(f"llama.cpp ({self.config}) crashed earlier: {self.crashed}")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=self.timeout_s)
            tail = self.proc.stderr.read()[-400:].strip()
            self.crashed = f"exit code {self.proc.returncode}" + (f": {tail}" if tail else "")
            raise RuntimeError(f"llama.cpp ({self.config}) crashed: {self.crashed}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp ({self.config}): {answer['error']}")
        return answer["value"]

    def decode(self, batch: list[list[int]], new_tokens: int) -> float:
        return self._call("decode", batch=batch, new_tokens=new_tokens)

    def decode_step_ms(self, prompt: list[int], steps: int = 64) -> float:
        return self._call("decode_step_ms", prompt=prompt, steps=steps)

    def prefill(self, batch: list[list[int]]) -> float:
        return self._call("prefill", batch=batch)

    def teacher_forced_logits(self, cases: list[dict]) -> np.ndarray:
        """`LlamaCppBaseline.teacher_forced_logits` in the child, passed through a temporary `.npy` file."""
        with tempfile.TemporaryDirectory(prefix="hybridgate-llama-logits-") as folder:
            path = self._call("save_teacher_forced_logits", cases=cases, path=str(Path(folder) / "logits.npy"))
            return np.load(path).astype(np.float64)

    def close(self) -> None:
        end_stdin_child(self.proc)


def _serve() -> None:
    """The child: one JSON request per stdin line, one JSON answer per stdout line."""
    base = None
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp's own prints stay off the answer channel
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "init":
                base = LlamaCppBaseline(Path(req["path"]), req["threads"], req["max_seqs"],
                                        extra_bufts=req["extra_bufts"])
                value = base.build()
            else:
                value = getattr(base, op)(**req)
            out.write(json.dumps({"value": value}) + "\n")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the baseline
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
    if base is not None:
        base.close()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level, text, user_data):  # pragma: no cover - called from C
    return None


def start_baselines(path: Path, out: dict, max_seqs: int, llama_cpp_path: str | None) -> dict:
    """llama.cpp with its defaults and with extra buffer types off, each in its own process; a
    configuration that fails to start is reported in `out` and left out."""
    bases, out["llama_cpp"] = {}, {}
    for config in CONFIGS:
        name = f"llama_cpp_{config}"
        try:
            bases[name] = LlamaCppProcess(path, out["threads"], max_seqs, config, llama_cpp_path)
            out["llama_cpp"][config] = bases[name].info
            print(f"{name}: llama-cpp-python {bases[name].info['version']} from {bases[name].info['path']} "
                  f"({bases[name].info['system_info'].strip()})", flush=True)
        except RuntimeError as exc:
            out["llama_cpp"][config] = {"error": str(exc)}
            print(f"{name}: {exc}", flush=True)
    return bases


if __name__ == "__main__":
    _serve()
