"""The torch runner's Triton kernels (CUDA; on a CPU device they run only under Triton's interpreter, in tests)."""
