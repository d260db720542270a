"""The Numba runner on GGUF quant blocks.

Importing this package does not import Numba: `isa.select()` must run first so
that Numba compiles for the chosen instruction set (see `isa`); every kernel
module selects the default path when it is imported without a choice made.
Compiled kernels are cached on disk (`cache=True`) in NUMBA_CACHE_DIR, by default
~/.cache/hybridgate/numba/<digest>-<isa>, outside the source tree so read-only
installs and containers work.
"""
