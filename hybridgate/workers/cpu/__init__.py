"""The Numba runner on GGUF quant blocks.

Compiled kernels are cached on disk (`cache=True`) in NUMBA_CACHE_DIR, by
default ~/.cache/hybridgate/numba, outside the source tree so read-only
installs and containers work; set before Numba is first imported.
"""

import os
from pathlib import Path

os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "hybridgate" / "numba"))
