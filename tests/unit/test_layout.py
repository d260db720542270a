"""`hybridgate serve`'s worker layout: the default, the overrides, and the errors naming the flags."""

from __future__ import annotations

import pytest

from hybridgate.serve import ServeConfig, cuda_present, worker_layout


def test_default_layout_follows_cuda():
    assert worker_layout(ServeConfig(model_path="m.gguf")) == (["gpu", "cpu"] if cuda_present() else ["cpu"])


@pytest.mark.parametrize(("gpu", "cpu", "kinds"), [(1, 0, ["gpu"]), (0, 2, ["cpu", "cpu"]), (2, 1, ["gpu", "gpu", "cpu"])])
def test_counts_override_the_default(gpu, cpu, kinds):
    assert worker_layout(ServeConfig(model_path="m.gguf", gpu_workers=gpu, cpu_workers=cpu)) == kinds


@pytest.mark.parametrize(("gpu", "cpu", "flag"), [(0, 0, "at least one worker"), (-1, 1, "--gpu-workers"),
                                                  (1, -2, "--cpu-workers")])
def test_bad_counts_name_the_flag(gpu, cpu, flag):
    with pytest.raises(ValueError, match=flag):
        worker_layout(ServeConfig(model_path="m.gguf", gpu_workers=gpu, cpu_workers=cpu))
