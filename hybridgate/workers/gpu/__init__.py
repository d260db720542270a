"""The PyTorch runner: Llama forward over dequantized GGUF weights, the torch sampler."""
