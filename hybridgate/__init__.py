"""hybridgate: an async token-streaming gateway for LLM inference with GPU-CPU hybrid workers."""

__version__ = "0.1.0"
