"""What a child process of `serve` (a worker, an extra gateway) does to end with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time


def die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent dies: PR_SET_PDEATHSIG on Linux, and a poll everywhere."""
    if parent_pid is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.2)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
