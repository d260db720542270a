"""The configuration root: precedence flag > environment > file > default, errors that name
where a bad value came from and its limit, `hybridgate config`, and one declaration per default."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from hybridgate import cli, config
from hybridgate.config import check_settings, resolve, setting
from hybridgate.settings import COMMANDS, Settings

# (flag, environment variable, TOML key, path, [file value, env value, flag value], documented default)
THREE = [
    ("--port", "HYBRIDGATE_PORT", "port", "gateway.port", [7001, "7002", "7003"], 50051),
    ("--max-num-seqs", "HYBRIDGATE_MAX_NUM_SEQS", "max-num-seqs", "worker.scheduler.max_num_seqs",
     [3, "5", "7"], 64),
    ("--grace-period", "HYBRIDGATE_GRACE_PERIOD", "grace_period", "gateway.grace_s", [1.5, "2.5", "3.5"], 10.0),
]


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def value_at(settings, path: str):
    for part in path.split("."):
        settings = getattr(settings, part)
    return settings


def toml_value(v) -> str:
    return json.dumps(v)  # TOML and JSON agree on ints, floats, strings and arrays of strings


@pytest.mark.parametrize(("flag", "env", "key", "path", "values", "default"), THREE)
def test_flag_beats_env_beats_file_beats_default(tmp_path, flag, env, key, path, values, default):
    in_file, in_env, in_flag = values
    cfg = tmp_path / "hg.toml"
    cfg.write_text(f"{key} = {toml_value(in_file)}\n")
    cases = [  # (argv, environment, expected value, expected source)
        (["serve", "--config", str(cfg), flag, in_flag], {env: in_env}, type(default)(in_flag), "flag"),
        (["serve", "--config", str(cfg)], {env: in_env}, type(default)(in_env), "env"),
        (["serve", "--config", str(cfg)], {}, in_file, "file"),
        (["serve"], {}, default, "default"),
    ]
    for argv, environ, expected, source in cases:
        resolved = resolve(parse(*argv), environ=environ)
        assert (value_at(resolved.settings, path), resolved.sources[path]) == (expected, source), argv


def test_the_file_may_come_from_the_environment(tmp_path):
    cfg = tmp_path / "hg.toml"
    cfg.write_text('cpu-workers = 3\nprefix-caching = false\nworker = ["ipc:///a", "tcp://127.0.0.1:5"]\n')
    resolved = resolve(parse("config"), environ={"HYBRIDGATE_CONFIG": str(cfg)})
    s = resolved.settings
    assert (s.layout.cpu_workers, s.worker.engine.prefix_caching) == (3, False)
    assert s.layout.worker_endpoints == ("ipc:///a", "tcp://127.0.0.1:5")
    assert resolved.config_file == str(cfg) and resolved.sources["layout.cpu_workers"] == "file"


def test_existing_flag_spellings_still_work():
    s = resolve(parse(
        "serve", "--model", "m.gguf", "--host", "0.0.0.0", "--port", "0", "--metrics-port", "9100",
        "--grace-period", "3", "--worker-timeout", "2", "--worker-startup-timeout", "5", "--max-model-len", "100",
        "--kv-cache-memory", "64MiB", "--threads", "2", "--device", "cpu", "--no-prefix-caching", "--enforce-eager",
        "--gpu-workers", "0", "--cpu-workers", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"),
        environ={}).settings
    assert (s.model_path, s.gateway.host, s.gateway.port, s.gateway.metrics_port, s.gateway.grace_s) == \
        ("m.gguf", "0.0.0.0", 0, 9100, 3.0)
    assert (s.router.dead_after_s, s.router.startup_timeout_s, s.router.max_model_len) == (2.0, 5.0, 100)
    e = s.worker.engine
    assert (e.kv_cache_memory, e.threads, e.device, e.prefix_caching, e.enforce_eager) == \
        ("64MiB", 2, "cpu", False, True)
    assert (s.layout.gpu_workers, s.layout.cpu_workers) == (0, 2)
    assert (s.worker.scheduler.max_num_seqs, s.worker.scheduler.max_num_batched_tokens) == (8, 128)
    w = resolve(parse("worker", "--endpoint", "ipc:///tmp/w.sock", "--kind", "gpu"), environ={}).settings.worker
    assert (w.endpoint, w.kind) == ("ipc:///tmp/w.sock", "gpu")
    g = resolve(parse("gateway", "--worker", "ipc:///a", "--worker", "ipc:///b"), environ={}).settings
    assert g.layout.worker_endpoints == ("ipc:///a", "ipc:///b")


def test_serve_takes_the_redis_url_its_response_cache_needs():
    s = resolve(parse("serve", "--response-cache", "redis", "--redis-url", "redis://127.0.0.1:6390/0"),
                environ={}).settings
    assert (s.response_cache.mode, s.redis.url) == ("redis", "redis://127.0.0.1:6390/0")


def test_worker_defaults_to_the_cpu_runner_like_serve(capsys):
    w = resolve(parse("worker", "--endpoint", "ipc:///tmp/w.sock"), environ={}).settings.worker
    assert w.kind == "cpu"
    with pytest.raises(SystemExit):
        cli.main(["worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default cpu)" in text and "work in progress" not in text


@pytest.mark.parametrize(("argv", "words"), [
    (["serve", "--threads", "0"], ["--threads", ">= 1", "got 0"]),
    (["serve", "--port", "70000"], ["--port", "[0, 65535]", "70000"]),
    (["serve", "--worker-timeout", "0"], ["--worker-timeout", "> 0"]),
    (["gateway", "--stream-interval", "0"], ["--stream-interval", ">= 1", "got 0"]),
    (["bench", "gateway", "--coalesce", "on,maybe"], ["--coalesce", "on or off", "'on,maybe'"]),
    (["serve", "--kv-cache-memory", "abc"], ["--kv-cache-memory", "fraction in (0, 1]"]),
    (["serve", "--max-num-seqs", "many"], ["--max-num-seqs", "an integer", "many"]),
    (["worker", "--endpoint", "ipc:///x", "--kind", "tpu"], ["--kind", "tpu"]),
    (["worker", "--endpoint", "/tmp/w.sock"], ["--endpoint", "ipc://", "/tmp/w.sock"]),
    (["bench", "engine", "--threads", "0"], ["--threads", ">= 1"]),  # bench shares serve's bounds now
    (["bench", "accuracy", "--threads", "-2"], ["--threads", ">= 1"]),
    (["worker", "--endpoint", "ipc:///x", "--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp32", "bf16", "fp8"]),
    (["--log-level", "bogus", "config"], ["--log-level", "DEBUG", "CRITICAL", "'bogus'"]),  # was logging's traceback
])
def test_a_bad_flag_names_the_flag_and_the_limit(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and all(w in err for w in words), err


@pytest.mark.parametrize(("env", "text", "words"), [
    ("HYBRIDGATE_THREADS", "0", ["HYBRIDGATE_THREADS", ">= 1", "got 0"]),
    ("HYBRIDGATE_PORT", "x", ["HYBRIDGATE_PORT", "an integer", "'x'"]),
    ("HYBRIDGATE_GRACE_PERIOD", "-1", ["HYBRIDGATE_GRACE_PERIOD", ">= 0"]),
    ("HYBRIDGATE_PREFIX_CACHING", "maybe", ["HYBRIDGATE_PREFIX_CACHING", "true", "false"]),
    ("HYBRIDGATE_KV_CACHE_MEMORY", "0", ["HYBRIDGATE_KV_CACHE_MEMORY", "at least 1 MiB"]),
    ("HYBRIDGATE_GRACE_PERIOD", "nan", ["HYBRIDGATE_GRACE_PERIOD", "finite", "nan"]),
    ("HYBRIDGATE_WORKER_TIMEOUT", "inf", ["HYBRIDGATE_WORKER_TIMEOUT", "finite", "inf"]),
    ("HYBRIDGATE_HANDOFF_BUFFER_MEMORY", "0.5", ["HYBRIDGATE_HANDOFF_BUFFER_MEMORY", "bytes", "'0.5'"]),
    ("HYBRIDGATE_KV_CACHE_DTYPE", "float16", ["HYBRIDGATE_KV_CACHE_DTYPE", "fp32, fp16, bf16", "'float16'"]),
])
def test_a_bad_variable_names_the_variable_and_the_limit(env, text, words):
    with pytest.raises(ValueError) as exc:
        resolve(parse("serve"), environ={env: text})
    assert all(w in str(exc.value) for w in words), exc.value


@pytest.mark.parametrize(("line", "words"), [
    ("threads = 0", ["threads", ">= 1", "got 0"]),
    ("port = 65536", ["port", "[0, 65535]"]),
    ('max-num-seqs = "8"', ["max-num-seqs", "an integer"]),
    ("prefix_caching = 1", ["prefix_caching", "true or false"]),
    ("kind = 'tpu'", ["kind", "one of cpu, gpu"]),
    ("max_num_sequences = 8", ["max_num_sequences", "unknown setting"]),
    ("[gateway]\nport = 1", ["gateway", "unknown setting"]),
    ("threads = 2\nthreads = 3", ["not valid TOML"]),
])
def test_a_bad_file_value_names_the_file_the_key_and_the_limit(tmp_path, line, words):
    cfg = tmp_path / "hg.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(ValueError) as exc:
        resolve(parse("serve", "--config", str(cfg)), environ={})
    assert str(exc.value).startswith(str(cfg)) and all(w in str(exc.value) for w in words), exc.value


def test_a_key_given_in_both_spellings_is_refused(tmp_path):
    cfg = tmp_path / "hg.toml"
    cfg.write_text("max-num-seqs = 2\nmax_num_seqs = 3\n")
    with pytest.raises(ValueError, match="max_num_seqs: given twice"):
        resolve(parse("serve", "--config", str(cfg)), environ={})


def test_the_cli_turns_resolution_errors_into_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDGATE_MAX_NUM_SEQS", "0")
    assert cli.main(["config"]) == 2
    assert capsys.readouterr().err.strip() == "hybridgate config: error: HYBRIDGATE_MAX_NUM_SEQS: must be >= 1, got 0"
    monkeypatch.delenv("HYBRIDGATE_MAX_NUM_SEQS")
    assert cli.main(["worker"]) == 2
    assert "--endpoint: required" in capsys.readouterr().err


def test_config_json_lists_every_setting_with_its_source(tmp_path, capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith("HYBRIDGATE_")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "hg.toml"
    cfg.write_text("cpu-workers = 2\n")
    monkeypatch.setenv("HYBRIDGATE_THREADS", "3")
    assert cli.main(["config", "--json", "--config", str(cfg), "--port", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    user_facing = [f for f in config.specs(Settings) if f.meta["cli"]]
    assert sorted(out["settings"]) == sorted(s.path for s in user_facing) and len(user_facing) >= 20
    got = {path: (row["value"], row["source"]) for path, row in out["settings"].items()}
    assert got["gateway.port"] == (0, "flag") and got["worker.engine.threads"] == (3, "env")
    assert got["layout.cpu_workers"] == (2, "file") and got["worker.scheduler.max_num_seqs"] == (64, "default")
    assert out["config_file"] == str(cfg)
    assert {row["source"] for row in out["settings"].values()} == {"flag", "env", "file", "default"}


def test_config_is_cheap_and_prints_text():
    """As a user runs it: no torch or numba import, no model load."""
    code = ("import sys; from hybridgate import cli; rc = cli.main(['config', '--max-num-seqs', '9']); "
            "print('heavy:', sorted(m for m in ('torch', 'numba') if m in sys.modules)); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("worker.scheduler.max_num_seqs"))
    assert line.split()[1:4] == ["9", "flag", "--max-num-seqs"]
    assert "heavy: []" in out.stdout


def test_kv_cache_dtype_is_listed_and_reaches_the_worker_and_the_cpu_benches(capsys):
    assert cli.main(["config", "--kv-cache-dtype", "bf16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("worker.engine.kv_cache_dtype"))
    assert line.split()[1:4] == ['"bf16"', "flag", "--kv-cache-dtype"]
    for argv in (["worker", "--endpoint", "ipc:///x"], ["bench", "engine"], ["bench", "accuracy"]):
        assert resolve(parse(*argv, "--kv-cache-dtype", "fp16"), environ={}).settings.worker.engine.kv_cache_dtype \
            == "fp16"
    assert resolve(parse("serve"), environ={}).settings.worker.engine.kv_cache_dtype == "fp16"


@dataclasses.dataclass(frozen=True)
class _Part:
    """A part as another engineer would add it: new setting() fields and nothing else."""

    token: str | None = setting(None, "an API key", secret=True)
    retries: int = setting(2, "tries before giving up", low=0, high=9, flag="--max-retries")
    verbose: bool = setting(False, "say more")
    parent_pid: int | None = setting(None, "plumbing", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class _Root:
    part: _Part = dataclasses.field(default_factory=_Part)


def test_a_new_setting_field_gets_flag_env_file_and_check_with_no_other_edit(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    config.add_settings(parser, root=_Root)
    assert "--parent-pid" not in parser.format_help()  # plumbing gets no flag
    args = parser.parse_args(["--max-retries", "4", "--verbose"])
    resolved = resolve(args, environ={"HYBRIDGATE_TOKEN": "s3cret"})
    assert resolved.settings.part == _Part(token="s3cret", retries=4, verbose=True)
    text = config.report(resolved, as_json=True)
    assert "s3cret" not in text and json.loads(text)["settings"]["part.token"]["value"] == "<set>"
    unset = json.loads(config.report(resolve(parser.parse_args([]), environ={}), as_json=True))
    assert unset["settings"]["part.token"]["value"] == "<unset>"
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-retries", "10"])
    assert "--max-retries: must be in [0, 9], got 10" in capsys.readouterr().err
    with pytest.raises(ValueError, match="retries: must be in \\[0, 9\\], got -1"):
        _Part(retries=-1)
    cfg = tmp_path / "p.toml"
    cfg.write_text("max-retries = 5\nparent-pid = 1\n")
    with pytest.raises(ValueError, match="parent-pid: unknown setting"):  # plumbing is not in the file either
        resolve(parser.parse_args(["--config", str(cfg)]), environ={})


def _config_classes(root: type) -> list[type]:
    out = [root]
    for f in dataclasses.fields(root):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out += _config_classes(f.default_factory)
    return out


def test_no_default_is_defined_twice():
    """Every field under the root is a setting() (its default written there, once) or a section;
    names are unique; no command's parser carries a default of its own (argparse leaves each
    setting unset, so the value a command gets is the dataclass default)."""
    classes = _config_classes(Settings)
    assert {c.__name__ for c in classes} >= {"Settings", "GatewayConfig", "RouterConfig", "WorkerConfig",
                                             "SchedulerConfig", "EngineConfig", "LayoutConfig"}
    all_specs = config.specs(Settings)  # raises TypeError for a field declared without setting()
    for spec in all_specs:
        assert spec.meta["help"].strip(), spec.path
    user = [s for s in all_specs if s.meta["cli"]]
    for names in ([s.flag for s in user], [s.env for s in user]):
        assert len(names) == len(set(names))
    # One field name in two parts is the same setting declared twice, unless each names its own flag.
    by_leaf: dict[str, list] = {}
    for spec in all_specs:
        by_leaf.setdefault(spec.path.rsplit(".", 1)[-1], []).append(spec)
    for leaf, group in by_leaf.items():
        flags = [s.meta["flag"] for s in group]
        assert len(group) == 1 or (None not in flags and len(set(flags)) == len(flags)), \
            f"{leaf} declared in {[s.path for s in group]}"
    required_argv = {"worker": ["--endpoint", "ipc:///x"], "generate": ["hi"], "bench engine": [], "bench accuracy": []}
    for command in COMMANDS:
        args = parse(*command.split(), *required_argv.get(command, []))
        given = {s.path for s in all_specs if hasattr(args, s.path)}
        assert given <= {"worker.endpoint"}, (command, given)
        defaults = resolve(args, environ={}).settings
        for spec in config.select(Settings, COMMANDS[command].include, COMMANDS[command].exclude):
            if spec.path != "worker.endpoint":
                assert value_at(defaults, spec.path) == spec.default, (command, spec.path)


def test_a_list_setting_given_one_string_by_a_plain_namespace_is_one_item():
    # Embedders and tests resolve a SimpleNamespace; `model="/x.gguf"` is one model, not one per character.
    from types import SimpleNamespace

    from hybridgate.config import resolve
    from hybridgate.settings import Settings

    settings = resolve(SimpleNamespace(model="/models/a.gguf"), root=Settings).settings
    assert settings.model == ("/models/a.gguf",) and settings.model_path == "/models/a.gguf"
