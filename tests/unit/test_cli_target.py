"""`hybridgate --version`, and the clients (`generate`, `health`) finding the gateway where `serve` listens:
its --host and --port, from the same flags, HYBRIDGATE_* variables and --config file."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hybridgate import cli
from hybridgate.client import gateway_target
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
# The console script of the environment running the tests, on this checkout's code.
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridgate", *argv], capture_output=True, text=True, timeout=60,
                          env={**ENV, **(env or {})})


def test_version_is_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"hybridgate {version}\n", out


@pytest.mark.parametrize(("argv", "environ", "target"), [
    ((), {}, "127.0.0.1:50051"),
    ((), {"HYBRIDGATE_PORT": "6001"}, "127.0.0.1:6001"),
    ((), {"HYBRIDGATE_HOST": "10.1.2.3", "HYBRIDGATE_PORT": "6001"}, "10.1.2.3:6001"),
    (("--port", "6002"), {"HYBRIDGATE_PORT": "6001"}, "127.0.0.1:6002"),
    (("--target", "gw:7000"), {"HYBRIDGATE_PORT": "6001"}, "gw:7000"),
    ((), {"HYBRIDGATE_HOST": "0.0.0.0"}, "127.0.0.1:50051"),
    ((), {"HYBRIDGATE_HOST": "::"}, "[::1]:50051"),
    ((), {"HYBRIDGATE_HOST": "fd00::5", "HYBRIDGATE_PORT": "6001"}, "[fd00::5]:6001"),
])
@pytest.mark.parametrize("command", [("generate", "hi"), ("health",)])
def test_clients_reach_the_gateway_where_serve_listens(monkeypatch, command, argv, environ, target):
    for name in ("HYBRIDGATE_HOST", "HYBRIDGATE_PORT", "HYBRIDGATE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert gateway_target(cli.build_parser().parse_args([*command, *argv])) == target


def test_the_config_file_and_its_errors_are_serves(monkeypatch, tmp_path):
    for name in ("HYBRIDGATE_HOST", "HYBRIDGATE_PORT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "hg.toml").write_text("port = 6003\nmax-num-seqs = 8\n")
    monkeypatch.setenv("HYBRIDGATE_CONFIG", str(tmp_path / "hg.toml"))
    assert gateway_target(cli.build_parser().parse_args(["health"])) == "127.0.0.1:6003"
    monkeypatch.setenv("HYBRIDGATE_PORT", "70000")
    with pytest.raises(ValueError, match="HYBRIDGATE_PORT: .*65535"):
        gateway_target(cli.build_parser().parse_args(["health"]))
    monkeypatch.setenv("HYBRIDGATE_PORT", "0")
    with pytest.raises(ValueError, match="--port: 0 lets serve pick a free port"):
        gateway_target(cli.build_parser().parse_args(["health"]))


class _Answer(pb_grpc.GenerationServicer):
    def Generate(self, request, context):
        yield pb.GenerateResponse(text=f"echo {request.prompt}", finish_reason=pb.FINISH_REASON_STOP, route="cpu")


@pytest.fixture
def gateway():
    """A gRPC server with the health and Generation services on a free port (a stand-in for serve)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    pb_grpc.add_GenerationServicer_to_server(_Answer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def test_generate_and_health_commands_follow_hybridgate_port(gateway):
    env = {"HYBRIDGATE_PORT": str(gateway)}
    out = run("health", "--timeout", "10", env=env)
    assert out.returncode == 0 and out.stdout == f"gateway 127.0.0.1:{gateway}: SERVING\n", out
    out = run("health", "--timeout", "10", "--service", "chat", env=env)  # a service the gateway lacks: named
    assert out.returncode == 1 and out.stdout.startswith(f"gateway 127.0.0.1:{gateway} service chat: "), out
    out = run("generate", "hello", env=env)
    assert out.returncode == 0 and out.stdout == "echo hello\n", out


def _helps(command: str) -> dict[str, str]:
    import argparse

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.help for action in sub.choices[command]._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", ["generate", "health"])
def test_the_clients_help_says_they_connect_where_serve_listens(command):
    """generate --help described its --host as an "address to listen on" (serve's text)."""
    helps, served = _helps(command), _helps("serve")
    assert helps["--host"].startswith("the gateway's address to connect to") and "listen" not in helps["--host"]
    assert helps["--port"].startswith("the gateway's gRPC port to connect to") and "free" not in helps["--port"]
    assert served["--host"].startswith("address to listen on") and "0 picks a free one" in served["--port"]
    assert helps["--host"].endswith("[HYBRIDGATE_HOST]") and "(default 127.0.0.1)" in helps["--host"]


def test_generates_max_tokens_help_states_the_gateways_default():
    from hybridgate.router.prompts import DEFAULT_MAX_TOKENS_CAP

    text = _helps("generate")["--max-tokens"]
    assert "rest of the model's context" in text and f"at most {DEFAULT_MAX_TOKENS_CAP})" in text
    page = " ".join((ROOT / "docs" / "http-api.md").read_text().split())  # the HTTP API's page says it too
    assert f"min(max model length − prompt tokens, {DEFAULT_MAX_TOKENS_CAP})" in page


def test_generate_model_names_the_served_model_not_a_settings_path():
    from hybridgate.client import build_request

    args = cli.build_parser().parse_args(["generate", "--model", "chat", "--max-tokens", "3", "hi"])
    assert build_request(args, "hi") == pb.GenerateRequest(prompt="hi", model="chat", max_tokens=3)
    assert not build_request(cli.build_parser().parse_args(["generate", "hi"]), "hi").HasField("model")


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "--max-tokens must be in [1, 4294967295], got 0"),  # the gateway refuses 0 too
    (["--max-tokens", "-1"], "--max-tokens must be in [1, 4294967295], got -1"),
    (["--top-k", "-2"], "--top-k must be in [-1, 2147483647], got -2"),  # -1 and 0 turn it off
    (["--seed", "-1"], "--seed must be in [0, 18446744073709551615], got -1"),
])
def test_generate_refuses_what_the_gateway_would_naming_the_flag_and_its_range(flags, message):
    from hybridgate.client import build_request

    with pytest.raises(ValueError) as exc:
        build_request(cli.build_parser().parse_args(["generate", *flags, "hi"]), "hi")
    assert str(exc.value) == message


def test_a_reader_that_leaves_early_is_no_error():
    # `hybridgate info | head`: the command's writes meet a closed pipe; the CLI exits 0 with nothing on stderr
    code = ("import sys; from hybridgate import cli\n"
            "def info(args):\n"
            "    for _ in range(100_000):\n"
            "        print('x' * 100)\n"
            "cli._cmd_info = info\n"
            "sys.exit(cli.main(['info']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""
