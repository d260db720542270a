"""transformers as the reference for GGUF files of every architecture, with its GGUF loader's known
mistakes corrected by hand (FACTS.md, checked against llama.cpp on tiny F32 files):

- Llama 3 `rope_freqs.weight` is ignored: the rotary embedding's inverse frequencies are divided by it
  here (llama.cpp's `freq_factors`).
- qwen3 `attention.key_length` is not mapped (head_dim defaults to 128): set from the file.
- gemma2 `attn_logit_softcapping` / `final_logit_softcapping` are ignored (50/30 kept): set from the
  file; and queries are scaled by `query_pre_attn_scalar` 256 where llama.cpp uses 1/sqrt(head_dim)
  (gemma2 and gemma3 below 27B): set to head_dim.
- gemma3 ignores `sliding_window_pattern`: `layer_types` set from llama.cpp's pattern (layer il slides
  iff il % 6 < 5).
- phi3 ignores LongRoPE (`rope_factors_short/long.weight`, `rope.scaling.original_context_length`,
  `rope.scaling.attn_factor`; checked here on transformers 5.25): its `longrope` rope parameters are
  set from them.

Everything runs in fp32 with eager attention (the path that applies Gemma 2's softcap), one
forward over the whole sequence per call (no KV cache to trust).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _config_fixes(arch: str, meta: dict, config) -> dict:
    """Hand corrections of the loaded config, from the file's metadata and llama.cpp's rules."""
    fixes = {}
    head_dim = meta.get(f"{arch}.attention.key_length")
    if arch == "qwen3" and head_dim:
        fixes["head_dim"] = int(head_dim)
    if arch in ("gemma2", "gemma3"):
        fixes["query_pre_attn_scalar"] = int(head_dim or config.hidden_size // config.num_attention_heads)
    if arch == "gemma2":
        fixes["attn_logit_softcapping"] = float(meta.get("gemma2.attn_logit_softcapping", 50.0))
        fixes["final_logit_softcapping"] = float(meta.get("gemma2.final_logit_softcapping", 30.0))
    if arch == "gemma3":
        fixes["layer_types"] = ["sliding_attention" if i % 6 < 5 else "full_attention"
                                for i in range(config.num_hidden_layers)]
    return fixes


def _long_rope(arch: str, meta: dict, tensors: dict) -> dict:
    """transformers' `longrope` parameters from a Phi-3 file's factors and metadata (none without them)."""
    if "rope_factors_short.weight" not in tensors:
        return {}
    return {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "short_factor": tensors["rope_factors_short.weight"].tolist(),
        "long_factor": tensors["rope_factors_long.weight"].tolist(),
        "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
        "attention_factor": float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))}}


def load_reference(path: Path, metadata: dict, rope_tensors: dict[str, np.ndarray] | None = None):
    """transformers' causal LM of the GGUF at `path` (fp32, eager attention, eval), corrected as above.

    metadata: the file's key-value metadata as gguf reads it (`GGUFModel.metadata`, so the file is
    not parsed once more); rope_tensors: float32 values of the file's `rope_freqs.weight`,
    `rope_factors_short.weight` and `rope_factors_long.weight`, those it has.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path, tensors = Path(path), rope_tensors or {}
    arch = metadata["general.architecture"]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key, value in (_config_fixes(arch, metadata, config) | _long_rope(arch, metadata, tensors)).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if "rope_freqs.weight" in tensors:
        factors = torch.from_numpy(np.asarray(tensors["rope_freqs.weight"], dtype=np.float32))
        for module in model.modules():
            if hasattr(module, "inv_freq"):
                module.inv_freq = module.inv_freq / factors
                module.original_inv_freq = module.inv_freq
    return model


ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def rope_tensors(model) -> dict[str, np.ndarray]:
    """The RoPE factor tensors a `GGUFModel` holds, float32 (gguf's dequantizer)."""
    return {n: model.tensors[n].dequantize() for n in ROPE_TENSORS if n in model.tensors}


@torch.inference_mode()
def last_logits(model, ids) -> np.ndarray:
    """float32 `[vocab]` logits at the last position of `ids` (one sequence, whole forward)."""
    return model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float().numpy()


def greedy(model, ids, steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids for `steps` tokens after `ids`, and the top-2 logit gap at each step."""
    ids, out, gaps = list(ids), [], []
    for _ in range(steps):
        logits = last_logits(model, ids)
        top2 = np.sort(logits)[-2:]
        out.append(int(logits.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        ids.append(out[-1])
    return out, gaps


def assert_greedy_matches(got: list[int], want: list[int], gaps: list[float], tie: float = 1e-3) -> None:
    """Equal ids, or the first difference where the reference's top-2 gap is below `tie`."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < tie, f"greedy ids differ at step {i} ({a} vs {b}); reference top-2 gap {gaps[i]:.2e}"
            return
    assert len(got) == len(want)


def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The torch runner's greedy ids over its contiguous cache (`model`: a `DecoderModel`), and its top-2 logit
    gap at each step."""
    cache, out, gaps = model.new_cache(), [], []
    logits = model.forward(torch.tensor(prompt), [len(prompt)], [cache])[0].numpy()
    for _ in range(steps):
        top2 = np.sort(logits)[-2:]
        out.append(int(logits.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        logits = model.forward(torch.tensor(out[-1:]), [1], [cache])[0].numpy()
    return out, gaps


# ---- golden files of the reference's logits ----

SAMPLE_TOP, SAMPLE_RANDOM = 64, 64  # ids a golden keeps of a `[vocab]` logit vector


def logit_sample(logits: np.ndarray, rng: np.random.Generator) -> dict:
    """What a golden file keeps of the reference's float32 `[vocab]` logits at one position: the
    SAMPLE_TOP largest ids (largest first), SAMPLE_RANDOM other ids drawn by `rng` (ascending), their
    logits, and the largest logit."""
    top = np.argsort(logits)[::-1][:SAMPLE_TOP]
    others = rng.choice(np.setdiff1d(np.arange(logits.size), top), size=SAMPLE_RANDOM, replace=False)
    ids = np.concatenate([top, np.sort(others)])
    return {"ids": ids.tolist(), "logits": [float(v) for v in logits[ids]], "max": float(logits.max())}


def assert_logits_match(got: np.ndarray, sample: dict, tol: float, what: object = "") -> None:
    """`got` float32 `[vocab]` within `tol` of a `logit_sample` at its ids, and its largest logit within
    `tol` of the reference's (so no id outside the sample rises above the reference's top)."""
    err = float(np.abs(np.asarray(got)[sample["ids"]] - np.asarray(sample["logits"], np.float32)).max())
    assert err < tol, (what, err)
    assert abs(float(np.max(got)) - sample["max"]) < tol, (what, float(np.max(got)), sample["max"])


def weights_digest(model) -> str:
    """sha256 of a `GGUFModel`'s tensors (names, types and bytes, in name order): which weights a golden
    was made from, whatever the file's header says."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(model.tensors):
        tensor = model.tensors[name]
        digest.update(f"{name}:{int(tensor.ggml_type)}:".encode())
        digest.update(np.ascontiguousarray(tensor.data).tobytes())
    return digest.hexdigest()
