"""The settings of `serve` and `gateway` as deployments: which workers, and how `serve` restarts them.

Data only (the settings root composes it); `hybridgate.serve` and
`hybridgate.supervise` read these sections.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.config import check_settings, setting


@dataclass(frozen=True)
class LayoutConfig:
    """Which workers the gateway talks to: those `serve` starts, or running ones (`gateway`)."""

    gpu_workers: int | None = setting(
        None, "GPU workers (the PyTorch runner; on a CPU torch device where there is no CUDA); "
              "default: 1 where CUDA is present, else 0", low=0)
    cpu_workers: int = setting(1, "CPU workers (Numba kernels on the GGUF blocks); the workers that compute "
                                  "on the CPU share its cores unless --threads is given", low=0)
    worker_endpoints: tuple[str, ...] = setting(
        (), "a running worker's endpoint (ipc://PATH or tcp://HOST:PORT); repeat for several", flag="--worker")
    gateways: int = setting(
        1, "gateway processes serving the one gRPC port (SO_REUSEPORT among themselves only: a port another "
           "program holds is still refused), each with its own router, all sharing the workers; with "
           "--metrics-port P, gateway i serves its metrics on P+i", low=1, high=64)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = setting(
        0.5, "seconds before restarting a worker that exited; doubles with each restart within the window",
        low=0, flag="--worker-restart-backoff")
    restart_backoff_max_s: float = setting(10.0, "longest wait before a worker restart, seconds", low=0,
                                           flag="--worker-restart-backoff-max")
    max_restarts: int = setting(5, "restarts of one worker within --worker-restart-window after which it stays down",
                                low=0, flag="--worker-max-restarts")
    restart_window_s: float = setting(60.0, "seconds over which --worker-max-restarts counts restarts", low=0,
                                      low_open=True, flag="--worker-restart-window")

    def __post_init__(self) -> None:
        check_settings(self)
