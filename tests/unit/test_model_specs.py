"""Several models in the settings: `--model` values, the config file's [model] table, and `gateway`'s
`--worker NAME=ENDPOINT`."""

from __future__ import annotations

import argparse

import pytest

from hybridgate.config import resolve
from hybridgate.serve import static_pools, worker_layout
from hybridgate.serveconf import LayoutConfig, ModelSpec, parse_model_spec
from hybridgate.settings import Settings, add_command_settings


def parse(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_command_settings(parser, command)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("text", "spec"), [
    ("m.gguf", ModelSpec("", "m.gguf")),
    ("chat=/models/a.gguf", ModelSpec("chat", "/models/a.gguf")),
    ("chat=/models/a.gguf:cpu=2", ModelSpec("chat", "/models/a.gguf", None, 2)),
    ("chat=/models/a.gguf:gpu=1:cpu=0", ModelSpec("chat", "/models/a.gguf", 1, 0)),
    ("org/Model-1.5B=/m:x.gguf", ModelSpec("org/Model-1.5B", "/m:x.gguf")),  # a colon not followed by a count
])
def test_model_values(text, spec):
    assert parse_model_spec(text) == spec


@pytest.mark.parametrize(("argv", "words"), [
    (["--model", "a.gguf", "--model", "b=b.gguf"], ["name each one"]),
    (["--model", "a=x.gguf", "--model", "a=y.gguf"], ["'a'", "twice"]),
    (["--model", "bad name=x.gguf"], ["letters, digits"]),
    (["--model", "a=:cpu=1"], ["names no GGUF file"]),
])
def test_bad_model_values_name_the_setting(argv, words):
    with pytest.raises(ValueError) as err:
        resolve(parse("serve", *argv), environ={})
    assert str(err.value).startswith("model: ") and all(w in str(err.value) for w in words), err.value


def test_single_model_command_line_is_unchanged():
    s = resolve(parse("serve", "--model", "m.gguf"), environ={}).settings
    assert s.model_path == "m.gguf" and s.models == (ModelSpec("", "m.gguf"),)
    assert resolve(parse("serve"), environ={}).settings.models == (ModelSpec("", ""),)  # the default model


def test_models_from_flags_environment_and_a_config_table(tmp_path):
    s = resolve(parse("serve", "--model", "a=x.gguf", "--model", "b=y.gguf:cpu=3"), environ={}).settings
    assert s.models == (ModelSpec("a", "x.gguf"), ModelSpec("b", "y.gguf", None, 3)) and s.model_path == "x.gguf"
    s = resolve(parse("serve"), environ={"HYBRIDGATE_MODEL": "a=x.gguf,b=y.gguf"}).settings
    assert [m.name for m in s.models] == ["a", "b"]
    cfg = tmp_path / "hg.toml"
    cfg.write_text('cpu-workers = 2\n[model]\nchat = "x.gguf"\nsmall = "y.gguf:gpu=0:cpu=1"\n')
    s = resolve(parse("serve", "--config", str(cfg)), environ={}).settings
    assert s.models == (ModelSpec("chat", "x.gguf"), ModelSpec("small", "y.gguf", 0, 1))
    layout = LayoutConfig(gpu_workers=0, cpu_workers=s.layout.cpu_workers)  # 2, from the file
    assert worker_layout(layout, s.models[0]) == ["cpu", "cpu"] and worker_layout(layout, s.models[1]) == ["cpu"]
    with pytest.raises(ValueError, match="of model small"):
        worker_layout(LayoutConfig(), ModelSpec("small", "y.gguf", 0, 0))


def test_gateway_workers_name_their_model():
    s = resolve(parse("gateway", "--model", "a=x.gguf", "--model", "b=y.gguf", "--worker", "ipc:///w0",
                      "--worker", "b=tcp://10.0.0.2:5555", "--worker", "a=ipc:///w1"), environ={}).settings
    pools = static_pools(s)
    assert [(p.name, p.path, p.endpoints) for p in pools] == [("a", "x.gguf", ("ipc:///w0", "ipc:///w1")),
                                                               ("b", "y.gguf", ("tcp://10.0.0.2:5555",))]
    with pytest.raises(ValueError, match="--worker: 'c=ipc:///w' names model 'c'"):
        static_pools(Settings(model=("a=x.gguf",), layout=LayoutConfig(worker_endpoints=("c=ipc:///w",))))


def test_the_model_table_picks_rows_by_name_and_names_the_served_ones():
    from types import SimpleNamespace

    from hybridgate.gateway.admission import Admission
    from hybridgate.gateway.models import ModelNotFoundError, ModelTable, ServedModel

    a, b = SimpleNamespace(ready=False), SimpleNamespace(ready=True)
    table = ModelTable([ServedModel(("a", "alias"), a, Admission(1)), ServedModel(("b",), b, Admission(1))])
    assert [table.pick(n).router for n in (None, "", "a", "alias", "b")] == [a, a, a, a, b]
    assert table.names == ["a", "alias", "b"] and table.ready  # some model serves
    with pytest.raises(ModelNotFoundError, match=r"`c` does not exist; this server serves a, alias, b"):
        table.pick("c")
    with pytest.raises(ValueError, match="'a' is given to two models"):
        ModelTable([ServedModel(("a",), a, Admission(1)), ServedModel(("b", "a"), b, Admission(1))])
