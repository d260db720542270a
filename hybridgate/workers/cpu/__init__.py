"""The Numba runner on GGUF quant blocks.

Compiled kernels are cached on disk (`cache=True`) in NUMBA_CACHE_DIR, by
default ~/.cache/hybridgate/numba/<digest>, outside the source tree so read-only
installs and containers work; set before Numba is first imported. Numba checks
only the source file of the function it caches, not the intrinsics and kernels
it calls from other files, so the default folder is named by a digest of this
package's sources: any change to them starts a fresh cache.
"""

import hashlib
import os
from pathlib import Path


def _sources_digest() -> str:
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "hybridgate" / "numba" / _sources_digest()))
