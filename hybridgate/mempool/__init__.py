"""Host memory: KV block allocator and pinned buffer pool (no torch import here)."""
