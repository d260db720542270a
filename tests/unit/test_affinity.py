"""Worker cores: the cpulist format (the kernel's, cpuset(7)), the settings' errors naming the setting and the
limit, NUMA nodes' cores read from sysfs, and serve's contiguous disjoint split among the workers computing
on the CPU."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

import pytest

from hybridgate.cpuset import format_cpulist, node_cores, parse_cpulist, split, worker_cores
from hybridgate.run.serve import cpu_engines
from hybridgate.workers.config import EngineConfig
from hybridgate.workers.affinity import prefer_node

SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}  # the kernel's syscall tables


@pytest.mark.parametrize(("text", "cores"), [
    ("0", (0,)), ("0-3,8", (0, 1, 2, 3, 8)), (" 8, 2-3 ,0", (0, 2, 3, 8)), ("4-4", (4,)), ("1,1,0-1", (0, 1)),
])
def test_a_cpulist_parses_to_its_sorted_cores(text, cores):
    assert parse_cpulist(text) == cores


@pytest.mark.parametrize(("cores", "text"), [
    ((0,), "0"), ((0, 1, 2, 3, 8), "0-3,8"), ((1, 3, 5), "1,3,5"), ((6, 7, 0, 1), "0-1,6-7"),
])
def test_cores_format_as_the_kernels_cpulist(cores, text):
    assert format_cpulist(cores) == text


@pytest.mark.parametrize("text", ["a", ",", "0,,1", "-1", "0-", "1-0", "0-3:2", "0 1"])
def test_a_bad_cpulist_names_the_setting_and_the_format(text):
    with pytest.raises(ValueError, match=r"^--cpu-cores: .*(cpulist such as 0-3,8|not a range of cores)"):
        parse_cpulist(text)


def test_cores_outside_the_process_mask_are_refused_naming_them_and_the_limit():
    with pytest.raises(ValueError, match=r"^--cpu-cores: cores 4-5 are not available to this process "
                                         r"\(it may run on 0-3\)"):
        worker_cores("2-5", None, available=(0, 1, 2, 3))
    with pytest.raises(ValueError, match="core 9 is not available"):
        worker_cores("9", None, available=(0, 1))


def test_no_setting_means_no_pinning():
    assert worker_cores("", None, available=(0, 1)) is None


@pytest.fixture
def two_nodes(tmp_path):
    """A sysfs node folder of a two-node host: cores 0-3 on node 0, 4-7 on node 1, and a memory-only node 2."""
    for node, cpulist in ((0, "0-3\n"), (1, "4-7\n"), (2, "\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist)
    (tmp_path / "online").write_text("0-2\n")  # not a node: a file of the same folder
    return tmp_path


def test_a_nodes_cores_come_from_its_cpulist(two_nodes):
    assert node_cores(1, two_nodes) == (4, 5, 6, 7)
    assert worker_cores("", 1, available=tuple(range(8)), root=two_nodes) == (4, 5, 6, 7)
    assert worker_cores("", 1, available=(0, 1, 5, 7), root=two_nodes) == (5, 7)  # those the process may use
    assert worker_cores("5-6", 1, available=tuple(range(8)), root=two_nodes) == (5, 6)


def test_a_node_that_does_not_exist_names_the_setting_and_the_nodes_that_do(two_nodes):
    with pytest.raises(ValueError, match=r"^--numa-node: node 3 does not exist \(nodes here: 0-2\)"):
        node_cores(3, two_nodes)
    with pytest.raises(ValueError, match="--numa-node: node 2 has no cores"):
        node_cores(2, two_nodes)


def test_cores_off_the_node_or_a_node_out_of_reach_are_refused(two_nodes):
    with pytest.raises(ValueError, match=r"--cpu-cores: cores 2-3 are not on --numa-node 1 \(its cores: 4-7\)"):
        worker_cores("2-5", 1, available=tuple(range(8)), root=two_nodes)
    with pytest.raises(ValueError, match=r"--numa-node: none of node 1's cores \(4-7\) is available"):
        worker_cores("", 1, available=(0, 1), root=two_nodes)


def test_this_hosts_node_0_holds_the_cores_this_process_runs_on():
    expected = parse_cpulist(open("/sys/devices/system/node/node0/cpulist").read())
    assert node_cores(0) == expected
    if not os.path.exists("/sys/devices/system/node/node1"):  # one node: it holds every core
        assert worker_cores("", 0) == tuple(sorted(os.sched_getaffinity(0)))
    assert EngineConfig(numa_node=0).numa_node == 0


def test_the_engine_settings_refuse_bad_cores_and_nodes_when_built():
    with pytest.raises(ValueError, match="--cpu-cores: core 100000 is not available"):
        EngineConfig(cpu_cores="100000")
    with pytest.raises(ValueError, match="--cpu-cores: expected a cpulist"):
        EngineConfig(cpu_cores="zero")
    with pytest.raises(ValueError, match=r"--numa-node: node 4096 does not exist \(nodes here: "):
        EngineConfig(numa_node=4096)
    with pytest.raises(ValueError, match="numa_node: must be >= 0"):
        EngineConfig(numa_node=-1)


def test_node_0_becomes_the_threads_preferred_memory_or_a_warning_says_why_not(caplog):
    """Read back with get_mempolicy(2) on the same thread (the policy is per thread): MPOL_PREFERRED (1) on
    node 0. Containers' default seccomp profile refuses set_mempolicy without CAP_SYS_NICE: then the warning."""
    number = SYS_GET_MEMPOLICY.get(platform.machine())
    if number is None:
        pytest.skip(f"get_mempolicy's number is unknown on {platform.machine()}")
    seen = {}

    def probe() -> None:  # on a thread of its own: the test process's threads keep their policy
        seen["set"] = prefer_node(0)
        mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
        seen["read"] = ctypes.CDLL(None, use_errno=True).syscall(number, ctypes.byref(mode), mask, 16 * 64, None, 0)
        seen["mode"], seen["mask"] = mode.value, mask[0]

    with caplog.at_level(logging.WARNING, logger="hybridgate.worker"):
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
    if seen["set"]:
        assert (seen["read"], seen["mode"], seen["mask"]) == (0, 1, 1)
    else:
        assert "--numa-node 0: memory not bound to the node (set_mempolicy: " in caplog.text


@pytest.mark.parametrize(("cores", "workers", "slices"), [
    ((0, 1), 2, [(0,), (1,)]),
    ((0, 1, 2, 3, 4), 2, [(0, 1, 2), (3, 4)]),
    ((0, 1, 2, 3, 8, 9, 10), 3, [(0, 1, 2), (3, 8), (9, 10)]),
    ((4, 5, 6, 7), 1, [(4, 5, 6, 7)]),
    ((0, 1), 3, None),
])
def test_the_split_is_contiguous_disjoint_and_covers_every_core(cores, workers, slices):
    assert split(cores, workers) == slices


def test_two_cpu_workers_under_serve_get_disjoint_cores_and_a_thread_each(monkeypatch):
    engines = cpu_engines(EngineConfig(), ["cpu", "cpu"], cuda=False, available=(0, 1))
    assert [(e.cpu_cores, e.threads) for e in engines] == [("0", 1), ("1", 1)]
    monkeypatch.setattr("hybridgate.cpuset.available_cores", lambda: tuple(range(8)))  # what EngineConfig checks
    engines = cpu_engines(EngineConfig(), ["gpu", "cpu", "cpu"], cuda=False, available=tuple(range(8)))
    assert [(e.cpu_cores, e.threads) for e in engines] == [("0-2", 3), ("3-5", 3), ("6-7", 2)]


def test_serve_splits_the_cpu_cores_setting_and_keeps_threads_given():
    engines = cpu_engines(EngineConfig(cpu_cores="0-1", threads=2), ["cpu", "cpu"], cuda=False, available=(0, 1))
    assert [(e.cpu_cores, e.threads) for e in engines] == [("0", 2), ("1", 2)]


def test_a_gpu_worker_on_cuda_is_left_out_of_the_split():
    engines = cpu_engines(EngineConfig(cpu_cores="0-1"), ["gpu", "cpu", "cpu"], cuda=True, available=(0, 1, 2))
    assert [(e.cpu_cores, e.threads) for e in engines] == [("", None), ("0", 1), ("1", 1)]


def test_a_lone_worker_is_pinned_only_when_its_cores_are_named():
    assert [e.cpu_cores for e in cpu_engines(EngineConfig(), ["cpu"], cuda=False, available=(0, 1))] == [""]
    assert [e.cpu_cores for e in cpu_engines(EngineConfig(cpu_cores="1"), ["cpu"], cuda=False,
                                             available=(0, 1))] == ["1"]


def test_fewer_cores_than_workers_means_no_pinning_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridgate"):
        engines = cpu_engines(EngineConfig(), ["cpu", "cpu", "cpu"], cuda=False, available=(0, 1))
    assert [(e.cpu_cores, e.threads) for e in engines] == [("", 1)] * 3
    assert "2 cores (0-1) for 3 workers computing on the CPU" in caplog.text and "not pinned" in caplog.text
