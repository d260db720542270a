"""Secret files.

Secrets are read only from files their owner alone can read (mode 0600 or
narrower): a token or key in a file others can read is no longer a secret, so
a wider mode is refused, naming the flag, the path and the mode, never the
content (OpenSSH refuses private keys the same way).
"""

from __future__ import annotations

import os
import stat


def check_secret_mode(path: str, flag: str) -> None:
    """Raises ValueError naming `flag`, `path` and the mode when `path` grants any access to group or
    others, or is not a regular file; OSError naming `flag` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise OSError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag}: {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{flag}: {path} has mode {mode:04o}, readable beyond its owner; a secret file must "
                         f"have mode 0600 or narrower (chmod 600 {path})")


def read_secret_file(path: str, flag: str) -> str:
    """The text of `path`, stripped of surrounding whitespace, after `check_secret_mode`.
    Raises ValueError (also when it is empty) or OSError, naming `flag`; never showing the content."""
    check_secret_mode(path, flag)
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text
