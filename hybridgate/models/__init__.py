"""Model formats without torch: GGUF reading, config, tokenizer, chat template, fingerprint."""

from hybridgate.models.architectures import (
    ARCHITECTURES,
    REFUSED_ARCHITECTURES,
    Activation,
    Architecture,
    Gating,
    MixtureOfExperts,
    RopeLayout,
)
from hybridgate.models.chat import ChatTemplate, ChatTemplateError
from hybridgate.models.detokenizer import IncrementalDetokenizer
from hybridgate.models.fingerprint import model_fingerprint
from hybridgate.models.gguf_file import GGUFModel, ModelConfig, ModelLoadError, TensorView, load_gguf
from hybridgate.models.gguf_metadata import read_metadata
from hybridgate.models.paths import default_model_path, model_name, model_names, served_name
from hybridgate.models.tokenizer import Tokenizer

__all__ = [
    "ARCHITECTURES",
    "Activation",
    "Architecture",
    "Gating",
    "MixtureOfExperts",
    "REFUSED_ARCHITECTURES",
    "RopeLayout",
    "ChatTemplate",
    "ChatTemplateError",
    "GGUFModel",
    "IncrementalDetokenizer",
    "ModelConfig",
    "ModelLoadError",
    "TensorView",
    "Tokenizer",
    "default_model_path",
    "load_gguf",
    "model_fingerprint",
    "model_name",
    "model_names",
    "read_metadata",
    "served_name",
]
