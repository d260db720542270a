"""A worker's threads: each one that dies of an exception ends the process, so supervision restarts it.

A worker whose I/O thread, engine loop, KV export thread or registration
thread has died is useless while alive (no heartbeat, no progress, hand-offs
that never leave, an entry that expires while it still runs). Exiting lets
`serve` (or any supervisor) start a fresh one; `os._exit` because the other
threads cannot be joined. Once `stopping` is set the worker is shutting down,
and an exception (a socket closed under the thread) ends only the thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("hybridgate.worker")

EXIT_THREAD_DIED = 70  # EX_SOFTWARE: an internal error ended a worker thread


def exit_if_raises(target: Callable[[], object], what: str,
                   stopping: threading.Event | None = None) -> Callable[[], None]:
    """`target` wrapped so that an exception escaping it ends the process with EXIT_THREAD_DIED,
    logging `what` died (critical, with the traceback); after `stopping` is set, only the thread ends."""

    def run() -> None:
        try:
            target()
        except BaseException:
            if stopping is not None and stopping.is_set():
                return
            log.critical("the worker's %s died; exiting so that it can be restarted", what, exc_info=True)
            logging.shutdown()
            os._exit(EXIT_THREAD_DIED)

    return run


def worker_thread(target: Callable[[], object], name: str, what: str,
                  stopping: threading.Event | None = None) -> threading.Thread:
    """A daemon thread (not started) running `target` under `exit_if_raises`."""
    return threading.Thread(target=exit_if_raises(target, what, stopping), name=name, daemon=True)
