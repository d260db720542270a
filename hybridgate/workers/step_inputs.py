"""A scheduled batch as flat int64 arrays: what both runners feed their kernels.

Written into one `PinnedPool` buffer per step, so staging allocates nothing on
the hot path; runners size their buffers with `staging_bytes`, so that no step
is larger than a buffer (one that is goes to a plain array, counted as a pool
fallback).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridgate.workers.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slots: np.ndarray  # int64 [num_tokens]: KV slot of each new token
    decode_context: np.ndarray  # int64 [num_decodes, width]: context slots of single-token entries, padded
    prefill_context: np.ndarray  # int64 [sum of prefill contexts]
    last: np.ndarray  # int64 [num_entries]: row of each entry's last token
    decodes: list[int]  # entries with one new token
    prefills: list[tuple[int, int, int, int]]  # (first row, new tokens, context offset, context length)
    contexts: list[int]  # context length of each entry after this step
    width: int  # the longest decode context
    decode_tables: np.ndarray  # int64 [num_decodes, max_blocks]: block tables of decodes, padded
    # int64 [n], ascending: rows holding prompt tokens of prompts of at least `long_prompt` tokens (the CPU
    # runner's AMX prompt matmuls; empty when the runner asked for none). A row's membership depends on its
    # own request only, never on its batch mates or on how its prompt was chunked.
    prompt_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # int64 [m], ascending: the rows of `prompt_rows` whose prompts have at least `expert_long_prompt` tokens,
    # the rows a mixture of experts multiplies on its prompt kernels (the same rule, a higher threshold)
    expert_prompt_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def context_slots(table: np.ndarray, block_size: int, length: int) -> np.ndarray:
    """Slots of positions 0..length-1 for a block table (int64 `[length]`)."""
    return (table[:, None] * block_size + np.arange(block_size)).ravel()[:length]


def staging_bytes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """Bytes of the largest step `build_step_inputs` writes into its buffer: int64 ids, positions and slots
    of at most `max_num_batched_tokens` rows, the last row of at most `max_num_seqs` entries, and the
    contexts, each at most `max_model_len`, of at most min(max_num_seqs, max_num_batched_tokens) entries
    (decodes' padded to the longest, prefills' whole). Reached by max_num_seqs - 1 decodes at
    max_model_len tokens beside one prefill chunk of the rest of the token budget ending there."""
    entries = min(max_num_seqs, max_num_batched_tokens)
    return 8 * (3 * max_num_batched_tokens + entries + entries * max_model_len)


def build_step_inputs(batch: ScheduledBatch, block_size: int, buf, pad_slot: int,
                      long_prompt: int | None = None, expert_long_prompt: int | None = None) -> StepInputs:
    """The step's inputs; decode contexts are padded with `pad_slot` (which must hold finite values),
    decode block tables with the block of `pad_slot`. long_prompt: the prompt length from which a
    prompt's tokens are listed in `prompt_rows` (None: none are); a resumed stream's replayed ids are not;
    expert_long_prompt (at least long_prompt): the same for `expert_prompt_rows` (None: none are)."""
    entries = batch.entries
    tables = [np.asarray(s.block_table, dtype=np.int64) for s, _ in entries]
    decodes = [i for i, (_, n) in enumerate(entries) if n == 1]
    prefills = [i for i, (_, n) in enumerate(entries) if n > 1]
    contexts = [s.num_computed + n for s, n in entries]
    width = max((contexts[i] for i in decodes), default=0)
    t = batch.num_tokens
    sizes = [t, t, t, len(decodes) * width, sum(contexts[i] for i in prefills), len(entries)]
    total = sum(sizes)
    flat = buf.fit(np.int64, total) if buf is not None else np.empty(total, np.int64)
    ids, pos, slots, dctx, pctx, last = np.split(flat, np.cumsum(sizes)[:-1])
    row = 0
    for (seq, n), table in zip(entries, tables):
        p = np.arange(seq.num_computed, seq.num_computed + n)
        ids[row : row + n] = seq.all_ids[seq.num_computed : seq.num_computed + n]
        pos[row : row + n] = p
        slots[row : row + n] = table[p // block_size] * block_size + p % block_size
        row += n
    last[:] = np.cumsum([n for _, n in entries]) - 1
    dctx = dctx.reshape(len(decodes), width)
    for j, i in enumerate(decodes):
        dctx[j, : contexts[i]] = context_slots(tables[i], block_size, contexts[i])
        dctx[j, contexts[i] :] = pad_slot
    offset, prefill_ctx = 0, []
    for i in prefills:
        pctx[offset : offset + contexts[i]] = context_slots(tables[i], block_size, contexts[i])
        prefill_ctx.append((int(last[i]) - entries[i][1] + 1, entries[i][1], offset, contexts[i]))
        offset += contexts[i]
    max_blocks = -(-width // block_size)
    tables_out = np.full((len(decodes), max_blocks), pad_slot // block_size, dtype=np.int64)
    for j, i in enumerate(decodes):
        used = -(-contexts[i] // block_size)
        tables_out[j, :used] = tables[i][:used]
    return StepInputs(ids, pos, slots, dctx, pctx, last, decodes, prefill_ctx, contexts, width, tables_out,
                      _prompt_rows(entries, long_prompt), _prompt_rows(entries, expert_long_prompt))


def _prompt_rows(entries: list, long_prompt: int | None) -> np.ndarray:
    """int64 `[n]` ascending: the step's rows of prompt tokens of prompts of at least `long_prompt` tokens."""
    spans, row = [], 0
    for seq, n in entries if long_prompt is not None else ():
        # the request's own prompt: a resumed stream's replayed ids (the last first_token_index of
        # prompt_ids) run on the decode kernels, as they first did, so the stream continues bit for bit
        prompt = len(seq.prompt_ids) - seq.first_token_index
        if prompt >= long_prompt and seq.num_computed < prompt:
            spans.append(np.arange(row, row + min(n, prompt - seq.num_computed), dtype=np.int64))
        row += n
    return np.concatenate(spans) if spans else np.empty(0, np.int64)
