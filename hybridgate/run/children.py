"""What a child process of `serve` (a worker, an extra gateway) does to end with its parent, and how a
parent ends a child that serves requests on its stdin (the bench's llama.cpp baseline and bandwidth probe)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
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


def end_stdin_child(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """End a child that stops at the end of its stdin: close it and wait, then kill after `timeout_s`."""
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
