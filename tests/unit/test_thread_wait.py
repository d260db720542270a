"""The kernel threads' wait policy: the OpenMP variables the runtimes document, set before Numba's threads
start, and refused once they have (the runtime read its variables then). Each case runs in a fresh
interpreter, since the policy is chosen once per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = """
import json, os, sys
os.environ.update({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1", "KMP_BLOCKTIME": "9"})
from hybridgate.workers.cpu import threadwait
threadwait.select(sys.argv[1])
threadwait.select(sys.argv[1])  # the policy in force again: nothing to do
env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
import numba
numba.set_num_threads(1)  # starts the threading layer
try:
    threadwait.select("active" if sys.argv[1] == "passive" else "passive")
    error = None
except RuntimeError as exc:
    error = str(exc)
print(json.dumps({"env": env, "error": error}))
"""


def _run(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, policy], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("policy", "env"), [
    # GNU libgomp: PASSIVE spins 0 rounds; LLVM/Intel OpenMP: block time 0 ms. ACTIVE with the spin bounded
    # at GNU's default count (300,000) and LLVM's default block time (200 ms), so an idle worker sleeps.
    ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, "KMP_BLOCKTIME": "0"}),
    ("active", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}),
])
def test_the_policy_sets_the_runtimes_variables_and_is_fixed_once_threads_start(policy, env):
    got = _run(policy)
    assert got["env"] == env
    assert got["error"] and "cpu_thread_wait" in got["error"] and "new process" in got["error"]


def test_an_unknown_policy_is_refused_naming_the_setting():
    from hybridgate.workers.cpu import threadwait

    with pytest.raises(ValueError, match="cpu_thread_wait: expected one of passive, active, got 'spin'"):
        threadwait.select("spin")
