"""`hybridgate serve`'s worker layout: the default, the overrides, and the errors naming the flags."""

from __future__ import annotations

import pytest

from hybridgate.run.serve import LayoutConfig, cuda_present, worker_layout


@pytest.mark.parametrize(("cuda", "kinds"), [(True, ["gpu", "cpu"]), (False, ["cpu"])])
def test_default_layout_follows_cuda(monkeypatch, cuda, kinds):
    # DESIGN.md: one CPU worker without CUDA; one GPU and one CPU worker with it.
    monkeypatch.setattr("hybridgate.run.serve.cuda_present", lambda: cuda)
    assert worker_layout(LayoutConfig()) == kinds


def test_cuda_is_present_where_torch_finds_a_device():
    torch = pytest.importorskip("torch")
    assert cuda_present() == torch.cuda.is_available()


@pytest.mark.parametrize(("gpu", "cpu", "kinds"), [(1, 0, ["gpu"]), (0, 2, ["cpu", "cpu"]), (2, 1, ["gpu", "gpu", "cpu"])])
def test_counts_override_the_default(gpu, cpu, kinds):
    assert worker_layout(LayoutConfig(gpu_workers=gpu, cpu_workers=cpu)) == kinds


def test_no_worker_at_all_names_both_flags():
    with pytest.raises(ValueError, match="--gpu-workers, --cpu-workers: at least one worker"):
        worker_layout(LayoutConfig(gpu_workers=0, cpu_workers=0))


@pytest.mark.parametrize(("gpu", "cpu", "field"), [(-1, 1, "gpu_workers: must be >= 0, got -1"),
                                                   (1, -2, "cpu_workers: must be >= 0, got -2")])
def test_negative_counts_name_the_field_and_limit(gpu, cpu, field):
    with pytest.raises(ValueError, match=field):
        LayoutConfig(gpu_workers=gpu, cpu_workers=cpu)
