"""serve's supervisor gives up on a worker after its restarts; it says so only once every worker is down."""

from __future__ import annotations

import asyncio

from hybridgate.run.supervise import Supervisor, SupervisorConfig


def test_serve_stays_up_while_another_worker_serves_and_learns_when_none_can(tmp_path):
    sup = Supervisor({"gpu-0": None, "cpu-0": None}, SupervisorConfig(), tmp_path)
    gpu, cpu = sup.slots
    assert sup.gave_up() is None
    gpu.given_up, gpu.reason = True, "exit code 1; last error: OSError: no CUDA"
    assert sup.gave_up() is None  # cpu-0 still serves (or will be restarted)
    asyncio.run(asyncio.wait_for(_runs_on(sup), 5))
    cpu.given_up, cpu.reason = True, "killed by signal SIGKILL"
    assert sup.gave_up() == "worker gpu-0: exit code 1; last error: OSError: no CUDA; worker cpu-0: killed by signal SIGKILL"
    asyncio.run(asyncio.wait_for(sup.run(), 5))  # returns: nothing left to supervise


async def _runs_on(sup: Supervisor) -> None:
    task = asyncio.create_task(sup.run())
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
