"""The Numba runner on GGUF quant blocks."""
