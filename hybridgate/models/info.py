"""What a GGUF file holds and what this project makes of it: the lines of `hybridgate info`.

Each part (config, tokenizer, chat template) is read on its own, so a file refused by one
(an unknown architecture, pre-tokenizer, tokenizer model, tensor type, a missing tensor) still
shows the rest, with the refusal line in place of what could not be built.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from hybridgate.models.chat import ChatTemplate, ChatTemplateError
from hybridgate.models.gguf_file import GGUFModel, ModelLoadError, load_gguf
from hybridgate.models.paths import names_of
from hybridgate.models.tokenizer import Tokenizer
from hybridgate.wire import PoolingType

# The names llama.cpp writes in `tokenizer.ggml.model`, said in words (src/llama-vocab.cpp).
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece", "gemma4": "SentencePiece-style BPE",
                    "bert": "WordPiece", "t5": "Unigram", "rwkv": "RWKV", "plamo2": "PLaMo-2", "none": "no vocabulary"}


@dataclass(frozen=True)
class ModelReport:
    """What `describe` found: the loaded model (None when refused) and the refusal of each part
    that could not be built (empty when it was)."""

    path: Path
    metadata: dict[str, Any]
    tensor_types: dict[str, str]  # tensor name -> GGML type name (e.g. "Q4_K")
    parameters: int  # weights over all tensors
    model: GGUFModel | None
    model_refusal: str
    tokenizer_refusal: str
    template_refusal: str

    @property
    def quant_mix(self) -> list[tuple[str, int]]:
        """(type name, tensors of it), the most frequent type first."""
        return Counter(self.tensor_types.values()).most_common()


def _raw_header(path: Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """Metadata, tensor types and parameter count straight from gguf's reader (no validation),
    for a file that `load_gguf` refuses. Raises ModelLoadError when it is no GGUF file at all."""
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return metadata, types, sum(int(t.n_elements) for t in reader.tensors)


def describe(path: str | Path) -> ModelReport:
    """Load what can be loaded of `path` and keep each refusal's message.

    Raises:
        ModelLoadError: the file is missing or is not GGUF (nothing to describe).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    model, model_refusal = None, ""
    try:
        model = load_gguf(path)
    except ModelLoadError as exc:
        model_refusal = str(exc)
    if model is not None:
        metadata = model.metadata
        types = {name: t.ggml_type.name for name, t in model.tensors.items()}
        parameters = sum(math.prod(t.shape) for t in model.tensors.values())
    else:
        metadata, types, parameters = _raw_header(path)
    tokenizer, tokenizer_refusal, template_refusal = None, "", ""
    try:
        tokenizer = Tokenizer(metadata, build=False)  # the checks without the encoder (seconds on 262k pieces)
    except ModelLoadError as exc:
        tokenizer_refusal = str(exc)
    if tokenizer is not None and metadata.get("tokenizer.chat_template"):
        try:
            ChatTemplate(tokenizer)
        except ChatTemplateError as exc:
            template_refusal = str(exc)
    return ModelReport(path, metadata, types, parameters, model, model_refusal, tokenizer_refusal, template_refusal)


def _names(report: ModelReport) -> str:
    """The served name and its alias, as `serve` would answer to them with no name given."""
    names = names_of(report.path, report.metadata)
    return names[0] + (f" (also answers to {names[1]!r}, its general.name)" if len(names) > 1 else "")


def read_per_token(model: GGUFModel) -> tuple[int, int]:
    """(weight bytes, parameters) one token's forward reads: every tensor, but of each 3-D expert tensor
    (`*_exps`, weights and biases) only the `expert_used_count / expert_count` share its chosen experts hold (the
    "active parameters" of a mixture of experts). The token embedding counts in full, as the LM head reads it
    when tied and as model cards count it."""
    c = model.config
    share = c.experts_per_token / c.num_experts if c.num_experts else 1.0
    nbytes = parameters = 0.0
    for name, t in model.tensors.items():
        f = share if name.endswith(("_exps.weight", "_exps.bias")) else 1.0
        nbytes += f * t.data.nbytes
        parameters += f * math.prod(t.shape)
    return round(nbytes), round(parameters)


def _expert_lines(report: ModelReport) -> list[tuple[str, str]]:
    """The experts (count, active per token, shared) where the family has them, the pooling of an embedding
    model (`<arch>.pooling_type` other than none), and what a token reads."""
    model, lines = report.model, []
    c, moe = model.config, model.config.moe
    if moe is not None:
        shared = f"a shared expert of width {c.shared_expert_intermediate_size}" + \
            (" behind its own gate" if moe.shared_expert_gate else "") if moe.shared_expert else "no shared expert"
        if moe.beside_dense:
            shared += f", beside a dense FFN of width {'/'.join(map(str, sorted(set(c.layer_intermediate_sizes))))}"
        lines.append(("experts", f"{c.num_experts} per block, {c.experts_per_token} active per token "
                                 f"({moe.gating.value} gating{', renormalised' if moe.normalize else ''}), "
                                 f"width {c.expert_intermediate_size}{', with biases' if moe.biases else ''}, "
                                 f"{shared}"))
    if c.pooling_type:
        name = PoolingType(c.pooling_type).name.lower() if c.pooling_type in iter(PoolingType) else "unknown"
        lines.append(("pooling", f"{name} (pooling_type {c.pooling_type}): an embedding model, POST /v1/embeddings"))
    nbytes, parameters = read_per_token(model)
    size = report.path.stat().st_size
    lines.append(("read per token", f"{nbytes / 2**20:,.1f} MiB of weights ({parameters:,} active parameters, "
                                    f"{parameters / 1e6:.0f}M) of a {size / 2**20:,.1f} MiB file"))
    return lines


def report_lines(report: ModelReport) -> list[tuple[str, str]]:
    """(label, value) pairs of `hybridgate info`, runners left out (they need the workers' packages)."""
    meta = report.metadata
    arch = str(meta.get("general.architecture", "?"))
    kind = str(meta.get("tokenizer.ggml.model", "?"))
    template = "present" if meta.get("tokenizer.chat_template") else \
        "none (a base model: completions only; chats need --chat-template FILE)"
    if report.template_refusal:
        template = f"present but refused: {report.template_refusal}"
    lines = [
        ("model", str(report.path)),
        ("name", _names(report)),
        ("architecture", arch),
        ("parameters", f"{report.parameters:,} ({report.parameters / 1e6:.0f}M)"),
        ("quant mix", ", ".join(f"{name} {count}" for name, count in report.quant_mix)),
        ("tokenizer", f"{kind} ({TOKENIZER_MODELS.get(kind, 'unknown')}), pre-tokenizer "
                      f"{meta.get('tokenizer.ggml.pre', '(none)')}, {len(meta.get('tokenizer.ggml.tokens', ()))} "
                      "tokens"),
        ("chat template", template),
        ("context", str(meta.get(f"{arch}.context_length", "?"))),
    ]
    if report.model is not None:
        lines += _expert_lines(report)
    if report.model_refusal:
        lines.append(("refused", report.model_refusal))
    if report.tokenizer_refusal:
        lines.append(("refused", report.tokenizer_refusal))
    return lines
