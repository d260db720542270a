"""Several models in the settings: `--model` values, the config file's [model] table, and `gateway`'s
`--worker NAME=ENDPOINT`."""

from __future__ import annotations

import argparse

import pytest

from hybridgate.config import resolve
from hybridgate.run.serve import static_pools, worker_layout
from hybridgate.run.config import LayoutConfig, ModelSpec, parse_model_spec
from hybridgate.settings import Settings, add_command_settings, model_keys


def parse(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_command_settings(parser, command)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("text", "spec"), [
    ("m.gguf", ModelSpec("", "m.gguf")),
    ("chat=/models/a.gguf", ModelSpec("chat", "/models/a.gguf")),
    ("chat=/models/a.gguf,cpu-workers=2", ModelSpec("chat", "/models/a.gguf", (("layout.cpu_workers", 2),))),
    ("chat=/models/a.gguf,gpu-workers=1,cpu-workers=0",
     ModelSpec("chat", "/models/a.gguf", (("layout.gpu_workers", 1), ("layout.cpu_workers", 0)))),
    ("org/Model-1.5B=/m:x.gguf", ModelSpec("org/Model-1.5B", "/m:x.gguf")),  # a colon is part of the path
    ("base=b.gguf,chat-template=t.jinja,max-model-len=4096,served-model-name=x,served-model-name=y",
     ModelSpec("base", "b.gguf", (("router.chat_template", "t.jinja"), ("router.max_model_len", 4096),
                                  ("gateway.served_model_name", ("x", "y"))))),
    ("m.gguf,chat-template=", ModelSpec("", "m.gguf", (("router.chat_template", None),))),  # the model's own
])
def test_model_values(text, spec):
    assert parse_model_spec(text, model_keys()) == spec


@pytest.mark.parametrize(("argv", "words"), [
    (["--model", "a.gguf", "--model", "b=b.gguf"], ["name each one"]),
    (["--model", "a=x.gguf", "--model", "a=y.gguf"], ["'a'", "twice"]),
    (["--model", "bad name=x.gguf"], ["letters, digits"]),
    (["--model", "a=,cpu-workers=1"], ["names no GGUF file"]),
    (["--model", "a=x.gguf:gpu=0:cpu=1"], ["model 'a'", "gpu-workers=N"]),  # the old form says the new one
    (["--model", "a=x.gguf,threads=2"], ["model 'a'", "'threads' is not a per-model", "chat-template",
                                         "cpu-activations"]),
    (["--model", "a=x.gguf,cpu-activations=i9"], ["model 'a', key cpu-activations", "auto, f32, i16, i8", "'i9'"]),
    (["--model", "a=x.gguf,cpu-workers=-1"], ["model 'a', key cpu-workers", ">= 0"]),
    (["--model", "a=x.gguf,max-model-len=64,max-model-len=128"], ["key max-model-len", "twice"]),
    (["--model", "cpu-workers=x.gguf"], ["no per-model key"]),
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
    s = resolve(parse("serve", "--model", "a=x.gguf", "--model", "b=y.gguf,cpu-workers=3"), environ={}).settings
    assert s.models == (ModelSpec("a", "x.gguf"), ModelSpec("b", "y.gguf", (("layout.cpu_workers", 3),)))
    assert s.model_path == "x.gguf"
    s = resolve(parse("serve"), environ={"HYBRIDGATE_MODEL": "a=x.gguf,cpu-workers=2,b=y.gguf"}).settings
    assert [(m.name, m.values) for m in s.models] == [("a", (("layout.cpu_workers", 2),)), ("b", ())]
    cfg = tmp_path / "hg.toml"
    cfg.write_text('cpu-workers = 2\ngpu-workers = 0\n[model]\nchat = "x.gguf"\nsmall = "y.gguf,cpu-workers=1"\n')
    s = resolve(parse("serve", "--config", str(cfg)), environ={}).settings
    assert s.models == (ModelSpec("chat", "x.gguf"), ModelSpec("small", "y.gguf", (("layout.cpu_workers", 1),)))
    assert worker_layout(s.model_settings(0).layout) == ["cpu", "cpu"]  # 2, from the file
    assert worker_layout(s.model_settings(1).layout) == ["cpu"]
    with pytest.raises(ValueError, match="of model small"):
        worker_layout(LayoutConfig(gpu_workers=0, cpu_workers=0), "small")


def test_models_tables_in_the_config_file(tmp_path):
    cfg = tmp_path / "hg.toml"
    cfg.write_text('chat-template = "all.jinja"\nmax-model-len = 2048\n'
                   '[models.chat]\npath = "x.gguf"\ncpu_workers = 2\nserved-model-name = ["c1", "c2"]\n'
                   '[models.base]\npath = "y.gguf"\nchat-template = "base.jinja"\nkv-cache-dtype = "fp32"\n')
    s = resolve(parse("serve", "--config", str(cfg)), environ={}).settings
    chat, base = s.model_settings(0), s.model_settings(1)
    assert [m.name for m in s.models] == ["chat", "base"]
    assert (chat.router.chat_template, base.router.chat_template) == ("all.jinja", "base.jinja")
    assert chat.router.max_model_len == base.router.max_model_len == 2048  # the global default reaches both
    assert (chat.layout.cpu_workers, base.layout.cpu_workers) == (2, 1)
    assert (chat.worker.engine.kv_cache_dtype, base.worker.engine.kv_cache_dtype) == ("fp16", "fp32")
    assert (chat.gateway.served_model_name, base.gateway.served_model_name) == (("c1", "c2"), ())
    cfg.write_text('[models.base]\npath = "y.gguf"\ncpu-activations = "i9"\n')
    with pytest.raises(ValueError, match=r"hg.toml: models: .*model 'base', key cpu-activations: .*auto, f32, i16"):
        resolve(parse("serve", "--config", str(cfg)), environ={})
    cfg.write_text('[models.base]\nchat-template = "t.jinja"\n')
    with pytest.raises(ValueError, match=r"\[models\]: base: .*needs path"):
        resolve(parse("serve", "--config", str(cfg)), environ={})


def test_a_global_value_is_the_default_and_the_served_aliases_name_the_first_model():
    s = resolve(parse("serve", "--chat-template", "g.jinja", "--served-model-name", "alias", "--cpu-workers", "2",
                      "--model", "a=x.gguf", "--model", "b=y.gguf,chat-template=b.jinja,cpu-workers=1"),
                environ={"HYBRIDGATE_TOOL_CALL_FORMAT": "hermes"}).settings
    a, b = s.model_settings(0), s.model_settings(1)
    assert (a.router.chat_template, b.router.chat_template) == ("g.jinja", "b.jinja")
    assert (a.layout.cpu_workers, b.layout.cpu_workers) == (2, 1)
    assert a.router.tool_call_format == b.router.tool_call_format == "hermes"
    assert (a.gateway.served_model_name, b.gateway.served_model_name) == (("alias",), ())
    assert s.router.chat_template == "g.jinja"  # the root keeps the global values


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


def test_config_shows_each_models_settings_and_where_each_came_from(tmp_path):
    import json

    from hybridgate.config import report
    from hybridgate.settings import model_rows

    cfg = tmp_path / "hg.toml"
    cfg.write_text('[models.base]\npath = "y.gguf"\nkv-cache-dtype = "fp32"\n')
    resolved = resolve(parse("config", "--config", str(cfg), "--chat-template", "g.jinja"),
                       environ={"HYBRIDGATE_CPU_WORKERS": "3"})
    rows = model_rows(resolved)["base"]
    assert rows["router.chat_template"] == {"value": "g.jinja", "source": "flag", "flag": "--chat-template",
                                            "env": "HYBRIDGATE_CHAT_TEMPLATE"}
    assert (rows["layout.cpu_workers"]["value"], rows["layout.cpu_workers"]["source"]) == (3, "env")
    assert rows["worker.engine.kv_cache_dtype"] == {"value": "fp32", "source": "file",
                                                    "flag": "--model base=...,kv-cache-dtype=",
                                                    "env": "HYBRIDGATE_KV_CACHE_DTYPE"}
    assert (rows["router.max_model_len"]["value"], rows["router.max_model_len"]["source"]) == (None, "default")
    text = report(resolved, models=model_rows(resolved))
    assert any(line.split()[:3] == ["models.base.worker.engine.kv_cache_dtype", '"fp32"', "file"]
               for line in text.splitlines()), text
    assert json.loads(report(resolved, as_json=True, models=model_rows(resolved)))["models"]["base"] == \
        model_rows(resolved)["base"]


def test_serve_gives_each_models_workers_its_own_settings():
    """The worker settings `serve` spawns: each model's count, KV cache, activations and max model length;
    the two cores split across the workers of both models (disjoint, one each)."""
    from hybridgate.run.serve import fleet_workers

    s = resolve(parse("serve", "--kv-cache-dtype", "bf16", "--max-model-len", "1024", "--cpu-workers", "1",
                      "--gpu-workers", "0", "--model", "a=x.gguf",
                      "--model", "b=y.gguf,kv-cache-dtype=fp32,cpu-activations=f32,max-model-len=512"),
                environ={}).settings
    pools, configs = fleet_workers(s, "/run/hg", available=(0, 1))
    assert [(p.name, p.worker_names) for p in pools] == [("a", ("a-cpu-0",)), ("b", ("b-cpu-0",))]
    a, b = configs["a-cpu-0"], configs["b-cpu-0"]
    assert (a.model_path, a.model_name, b.model_path, b.model_name) == ("x.gguf", "a", "y.gguf", "b")
    assert (a.engine.kv_cache_dtype, b.engine.kv_cache_dtype) == ("bf16", "fp32")
    assert (a.engine.cpu_activations, b.engine.cpu_activations) == ("auto", "f32")
    assert (a.max_model_len, b.max_model_len) == (1024, 512)
    assert (a.engine.cpu_cores, a.engine.threads, b.engine.cpu_cores, b.engine.threads) == ("0", 1, "1", 1)
    assert (a.endpoint, b.endpoint) == ("ipc:///run/hg/worker-0.sock", "ipc:///run/hg/worker-1.sock")


def test_the_model_flags_help_names_every_per_model_key():
    from hybridgate.config import specs

    help_text = next(s for s in specs(Settings) if s.path == "model").meta["help"]
    named = help_text.replace(" (repeat it for several aliases)", "").split("with the keys ", 1)[1].split(" (")[0]
    assert [k.strip() for k in named.split(",")] == list(model_keys())
