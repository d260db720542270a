"""The torch model runner: a scheduled batch in, one sampled id per ready sequence out."""

from __future__ import annotations

import torch

from hybridgate.models import GGUFModel
from hybridgate.workers.gpu import sampling
from hybridgate.workers.gpu.model import ContiguousKVCache, LlamaModel
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence


class TorchRunner:
    """Runs `LlamaModel` over per-sequence contiguous KV caches and samples on the device."""

    kind = "gpu"

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.model = LlamaModel(model, device, dtype)
        self.max_model_len = model.config.max_model_len
        self._live: dict[int, ContiguousKVCache] = {}
        self._vocab_hash = torch.from_numpy(sampling.vocab_hash(model.config.vocab_size)).to(self.model.device)

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        entries = batch.prefills + [(s, 1) for s in batch.decodes]
        ids: list[int] = []
        for seq, n in entries:
            if seq.cache is None:
                seq.cache = self._live[id(seq)] = self.model.new_cache(max(64, n))
            ids += seq.all_ids[seq.num_computed : seq.num_computed + n]
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.int64), [n for _, n in entries], [s.cache for s, _ in entries]
        )
        ready = []
        for row, (seq, n) in enumerate(entries):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                ready.append((row, seq))
        if not ready:
            return {}
        rows = torch.tensor([r for r, _ in ready], device=logits.device)
        seqs = [s for _, s in ready]
        sampled = sampling.sample(
            logits[rows],
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_ids) for s in seqs],
            [s.all_ids if s.params.repetition_penalty != 1.0 else () for s in seqs],
        )
        return dict(zip(seqs, sampled.tolist()))

    def free(self, seq: Sequence) -> None:
        self._live.pop(id(seq), None)
        seq.cache = None

    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in self._live.values())

    def warm_up(self) -> None:
        """One prefill and one decode step, so first requests do not pay one-time costs."""
        cache = self.model.new_cache()
        self.model.forward(torch.tensor([1, 2, 3, 4]), [4], [cache])
        self.model.forward(torch.tensor([5]), [1], [cache])
