"""Structured-output constraints in the engine: grammars compiled off the loop, one matcher per sequence,
token bitmasks filled while the forward pass runs.

Built on llguidance (Microsoft's Low-level Guidance: a Rust Earley parser with a
lexer over the token trie; docs/syntax.md for the grammar, docs/fast_forward.md
for the mask). Pieces:

- `build_ll_tokenizer`: llguidance's tokenizer from our GGUF tokenizer's token
  bytes (every vocabulary llguidance sees is exactly ours; control tokens are
  marked special, so grammar text never produces them), with the model's
  end-of-generation ids as its EOS set.
- `GrammarCompiler`: compiles a grammar text into a pristine `LLMatcher` on a
  small thread pool (llguidance drops the GIL while it builds), once per distinct
  text: an LRU keyed by the sha256 of the text, sharing one compile between the
  requests that wait on it. Each sequence gets a `deep_copy` of the pristine
  matcher (about 10 µs; the compiled grammar is shared). The grammar's first
  bitmask (the costliest, 100-200 µs for a JSON schema) is computed once there
  too, and given to every sequence that starts on it.
- `Constraints`: the engine's side. A constrained sequence waits for its grammar
  outside the scheduler (`waiting_for_grammar`) so it holds up no batch; once
  compiled it gets its matcher, fed with the ids already generated (a resumed
  stream's, a hand-off's), and joins the scheduler. Each step `start_masks`
  fills the bitmasks of the sequences that sample on a thread while the runner
  runs the forward pass; the runner joins it (`StepMasks.for_rows`) before it
  samples; `advance` feeds each sampled id back and stops a sequence whose
  grammar admits nothing more.

Bitmask layout (llguidance's, as `llguidance.numpy`): int32 `[rows, ceil(vocab / 32)]`,
bit j % 32 of word j // 32 set when id j is allowed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridgate.workers.config import EngineConfig

DEFAULT_GRAMMAR_CACHE_SIZE: int = EngineConfig.grammar_cache_size
DEFAULT_GRAMMAR_COMPILE_THREADS: int = EngineConfig.grammar_compile_threads
_FILL_SAMPLES = 4096  # recent per-sequence mask fill times kept for percentiles


class GrammarError(ValueError):
    """A grammar llguidance refuses (syntax, an unsupported feature, a limit); the message is llguidance's."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def build_ll_tokenizer(token_bytes: list[bytes], special_ids: Iterable[int], eos_ids: Iterable[int],
                       encode: Callable[[str], list[int]], bos_id: int = -1):
    """llguidance's `LLTokenizer` over our vocabulary.

    token_bytes: the bytes each id decodes to (`Tokenizer.token_bytes`, one per id); special_ids:
    control tokens (never produced by grammar text); eos_ids: the ids that end a generation (allowed
    only where the grammar accepts); encode: text to ids without special-token parsing (llguidance
    uses it to tokenize grammar-forced text).
    """
    import llguidance

    eos = sorted(set(eos_ids))
    if not eos:
        raise ValueError("eos_ids: the model has no end-of-generation id; a grammar could never end")

    class _Vocabulary:
        eos_token_id = eos[0]
        bos_token_id = bos_id if bos_id >= 0 else None
        tokens = token_bytes
        special_token_ids = sorted(set(special_ids))

        def __call__(self, text: bytes | str) -> list[int]:
            return encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=len(token_bytes),
                                  eos_token=eos)


def ll_tokenizer_of_metadata(metadata: dict[str, Any]):
    """`build_ll_tokenizer` for a GGUF file's tokenizer metadata (EOS set: `Tokenizer.stop_token_ids`)."""
    from hybridgate.models.tokenizer import Tokenizer

    tok = Tokenizer(metadata)
    # Filler (unused) tokens are special to llguidance, so grammar text never produces them.
    return build_ll_tokenizer(tok.written_bytes, {*tok.special_tokens.values(), *tok.unused_ids}, tok.stop_token_ids,
                              lambda text: tok.encode(text, special_tokens=False), tok.bos_token_id)


@dataclass
class CompilerStats:
    compiles: int = 0  # grammars compiled (cache misses that ran)
    compile_errors: int = 0  # of those, grammars llguidance refused
    compile_seconds: float = 0.0  # summed
    cache_hits: int = 0  # requests whose grammar was compiled or compiling already


@dataclass(frozen=True)
class CompiledGrammar:
    """A pristine matcher of one grammar and its first bitmask (int32 `[words]`): every sequence that starts
    on the grammar samples its first id under that same mask, computed once here, on the compile thread."""

    matcher: Any
    first_mask: np.ndarray


class GrammarCompiler:
    """Compiled grammars (`CompiledGrammar`) by sha256 of their text, compiled on a thread pool.

    `tokenizer`: a callable returning the `LLTokenizer` (built on the pool, on first use: about 0.1 s
    for 49k ids); cache_size: grammars kept, least recently used dropped first (failures are kept too,
    so a bad grammar is refused without recompiling); threads: compile threads.
    Raises ValueError for a cache size or thread count below 1.
    """

    def __init__(self, tokenizer: Callable[[], Any], cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
                 threads: int = DEFAULT_GRAMMAR_COMPILE_THREADS):
        if cache_size < 1:
            raise ValueError(f"grammar_cache_size: must be positive, got {cache_size}")
        if threads < 1:
            raise ValueError(f"grammar_compile_threads: must be positive, got {threads}")
        self.cache_size = cache_size
        self.stats = CompilerStats()
        self._cache: collections.OrderedDict[bytes, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._build_tokenizer = tokenizer
        self._tokenizer = None  # built by the first compile, on a compile thread
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self):
        """The `LLTokenizer` (built on first use; raises what building it raised)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    def submit(self, grammar: str) -> Future:
        """A future of the `CompiledGrammar`; it raises GrammarError for a grammar llguidance refuses."""
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            future = self._pool.submit(self._compile, grammar)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, grammar: str) -> CompiledGrammar:
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask

        tokenizer = self.tokenizer
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        first_mask = np.zeros((1, bitmask_words(tokenizer.vocab_size)), np.int32)
        if not matcher.is_error():
            fill_next_token_bitmask(matcher, first_mask, 0)
        elapsed = time.perf_counter() - started
        with self._lock:
            s = self.stats
            s.compiles += 1
            s.compile_seconds += elapsed
            s.compile_errors += matcher.is_error()
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return CompiledGrammar(matcher, first_mask[0])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ends_banned(seq) -> bool:
    """The sequence has generated fewer ids than its `min_tokens` (a resumed one counts the earlier ids)."""
    return seq.next_token_index < seq.params.min_tokens


def ban_ends(row: np.ndarray, seq, vocab_size: int) -> None:
    """Clear, in one bitmask row (int32 `[words]`, in place), the ids that would end `seq` while it is below
    its `min_tokens`: EOS (unless it ignores EOS) and its stop token ids, as vLLM's min_tokens does. A row
    left with no id allowed (a grammar that only accepts its end) is restored: the grammar wins."""
    if not _ends_banned(seq):
        return
    ends = {t for t in seq.params.stop_token_ids if t < vocab_size}
    if seq.eos_token_id >= 0 and not seq.params.ignore_eos:
        ends.add(seq.eos_token_id)
    if not ends:
        return
    words = row.view(np.uint32)
    kept = words.copy()
    for t in ends:
        words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if not words.any():
        words[:] = kept


class StepMasks:
    """The bitmasks of one step's masked sequences, filled on a thread while the forward pass runs.

    `for_rows(seqs)` waits for the fill and returns int32 `[len(seqs), words]` in that order, all
    bits set for a sequence without a matcher; None when none of `seqs` is constrained.
    """

    def __init__(self, rows: dict, bitmask: np.ndarray, done: Future):
        self.rows, self.bitmask, self._done = rows, bitmask, done  # bitmask's last row: all allowed
        self.wait_s = 0.0  # time `for_rows` waited for the fill

    def join(self) -> None:
        """Wait for the fill to end (its errors are raised by `for_rows`, not here)."""
        concurrent.futures.wait([self._done])

    def for_rows(self, seqs: list) -> np.ndarray | None:
        if not any(s in self.rows for s in seqs):
            return None
        started = time.perf_counter()
        self._done.result()
        self.wait_s += time.perf_counter() - started
        free = self.bitmask.shape[0] - 1
        return self.bitmask[[self.rows.get(s, free) for s in seqs]]


class Constraints:
    """The engine's constraint state (see the module doc). `compiler` None: constrained requests are refused."""

    def __init__(self, compiler: GrammarCompiler | None):
        self.compiler = compiler
        self.on_compiled: Callable[[], None] | None = None  # called on a compile thread when a grammar is ready
        # sequence -> (future of its pristine matcher, what to do once it has its matcher)
        self.waiting_for_grammar: dict = {}
        self._first_masks: dict = {}  # sequence -> its grammar's first bitmask, until its first step
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        self.requests = 0  # constrained sequences admitted (counter)
        self.mask_fills = 0  # sequence-steps whose bitmask was filled
        self.mask_fill_seconds = 0.0
        self.mask_wait_seconds = 0.0  # time the runner waited for a fill after its forward pass
        self.fill_times: collections.deque[float] = collections.deque(maxlen=_FILL_SAMPLES)  # per sequence-step

    def wait_for_grammar(self, seq, then: Callable[[], None]) -> None:
        """Hold `seq` until its grammar is compiled; `then()` schedules it (`poll` calls it)."""
        if self.compiler is None:
            future: Future = Future()
            future.set_exception(GrammarError("this worker has no tokenizer to enforce constraints with"))
        else:
            future = self.compiler.submit(seq.params.constraint.grammar)
        self.requests += 1
        self.waiting_for_grammar[seq] = (future, then)
        if self.on_compiled is not None:
            future.add_done_callback(lambda _: self.on_compiled())

    def discard(self, seq) -> None:
        """Forget a sequence (aborted or failed): its wait, its matcher."""
        self.waiting_for_grammar.pop(seq, None)
        self._first_masks.pop(seq, None)
        seq.matcher = None

    def poll(self) -> list[tuple[Any, str]]:
        """Give each sequence whose grammar is ready its matcher and schedule it; returns (sequence,
        reason) for those whose grammar failed or whose ids already generated it does not accept."""
        failed = []
        for seq, (future, then) in list(self.waiting_for_grammar.items()):
            if not future.done():
                continue
            del self.waiting_for_grammar[seq]
            error = future.exception()
            if error is not None:
                failed.append((seq, f"the constraint's grammar does not compile: {error}"))
                continue
            compiled = future.result()
            matcher = compiled.matcher.deep_copy()
            generated = seq.generated_ids
            if generated and not matcher.consume_tokens(generated):
                failed.append((seq, "the ids already generated for this request do not satisfy its constraint: "
                                    f"{matcher.get_error()}"))
                continue
            seq.matcher = matcher
            if not generated:
                self._first_masks[seq] = compiled.first_mask
            then()
        return failed

    def start_masks(self, seqs: list, vocab_size: int) -> StepMasks | None:
        """Start filling the bitmasks of the sequences among `seqs` (those sampling this step) that have
        one: a constraint's, and below `min_tokens` the ids that would end the sequence taken out
        (`ban_ends`). `vocab_size`: the runner's (the tokenizer's when constraints are compiled)."""
        masked = [s for s in seqs if s.matcher is not None or _ends_banned(s)]
        if not masked:
            return None
        vocab = self.compiler.tokenizer.vocab_size if self.compiler is not None else vocab_size
        bitmask = np.full((len(masked) + 1, bitmask_words(vocab)), -1, dtype=np.int32)
        rows = {s: i for i, s in enumerate(masked)}
        to_fill = []
        for i, seq in enumerate(masked):
            first = self._first_masks.pop(seq, None)
            if seq.matcher is None:
                ban_ends(bitmask[i], seq, vocab)
            elif first is None:
                to_fill.append((i, seq))
            else:  # a fresh matcher: its grammar's first mask, computed at compile time
                bitmask[i] = first
                ban_ends(bitmask[i], seq, vocab)
                self._count_fill(0.0)
        return StepMasks(rows, bitmask, self._fill_pool.submit(self._fill, to_fill, bitmask, vocab))

    def _fill(self, to_fill: list, bitmask: np.ndarray, vocab: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        for i, seq in to_fill:
            started = time.perf_counter()
            fill_next_token_bitmask(seq.matcher, bitmask, i)  # drops the GIL while it computes
            ban_ends(bitmask[i], seq, vocab)
            self._count_fill(time.perf_counter() - started)

    def _count_fill(self, seconds: float) -> None:
        self.fill_times.append(seconds)
        self.mask_fill_seconds += seconds
        self.mask_fills += 1

    def advance(self, seq, token: int) -> str | None:
        """Feed a sampled id to the sequence's matcher; returns an error message if the matcher
        refused it (an engine bug: the mask allowed it), else None."""
        if not seq.matcher.consume_token(token):
            return f"the constraint refused the sampled id {token}: {seq.matcher.get_error()}"
        return None

    def close(self) -> None:
        self._fill_pool.shutdown(wait=False)
        if self.compiler is not None:
            self.compiler.close()
