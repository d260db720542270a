"""deploy/kubernetes: each overlay rendered by kustomize (kubectl's), validated against the Kubernetes API
schemas of a named version, every hybridgate command, probe and HYBRIDGATE_ variable accepted by our CLI,
and the cpu-only topology (the key Job's command, Redis, a CPU worker advertising its address, an
authenticated gateway) run for real as processes on loopback, with its probes. No cluster is needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TIME_FACTOR, RedisServer, free_port, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Proc, metrics, stub
from test_deployment import CLI_VARIABLES, _accepts

KUBERNETES_VERSION = "1.32.0"  # the oldest minor the manifests promise (autoscaling/v2, policy/v1, appProtocol)
OVERLAYS = ("cpu-only", "gpu")
BIN = Path(sys.executable).parent
FRANCE = golden_json("greedy.json")["france"]


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl (with its kustomize) is missing: install Debian's kubernetes-client")
        pytest.skip("kubectl is missing")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/kubernetes/overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def containers(docs: list[dict]):
    """(object name, container) of every container and init container in the rendered objects."""
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        for c in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
            yield doc["metadata"]["name"], c


def hybridgate_argv(container: dict) -> list[str] | None:
    """What the container runs after `hybridgate` (the image's entrypoint), or None for a shell or another image."""
    if container["image"].split(":")[0].rsplit("/", 1)[-1] != "hybridgate":
        return None
    command = container.get("command")
    if command is None:
        return list(container.get("args", []))
    return command[1:] if command[0] == "hybridgate" else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_the_kubernetes_api(overlay, tmp_path):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler", "Job"} <= kinds
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    workers = {"gpu-worker"} if overlay == "gpu" else set()
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {"gateway", "cpu-worker", "redis"} | workers
    for name, c in containers(docs):  # the restricted profile on every container
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], (name, c["name"])
        assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
        assert "memory" in c["resources"]["limits"], (name, c["name"])
    if overlay == "gpu":
        gpu = next(d for d in docs if d["metadata"]["name"] == "gpu-worker" and d["kind"] == "Deployment")
        assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_probe_and_variable_is_accepted_by_our_cli(overlay):
    from hybridgate.config import select
    from hybridgate.settings import COMMANDS, Settings

    checked = 0
    for name, c in containers(render(overlay)):
        argv = hybridgate_argv(c)
        probes = [c.get(p, {}).get("exec", {}).get("command") for p in ("readinessProbe", "livenessProbe", "startupProbe")]
        for probe in [p for p in probes if p and p[0] == "hybridgate"]:
            ok, err = _accepts(probe[1:])
            assert ok, f"{name}/{c['name']} probe {probe}: {err}"
        if argv is None:
            continue
        ok, err = _accepts(argv)
        assert ok, f"{name}/{c['name']}: {argv}: {err}"
        checked += 1
        variables = {e["name"] for e in c.get("env", []) if e["name"].startswith("HYBRIDGATE_")}
        if argv[0] in COMMANDS:
            chosen = COMMANDS[argv[0]]
            accepted = {s.env for s in select(Settings, chosen.include, chosen.exclude)} | CLI_VARIABLES
            assert variables <= accepted, f"{name}/{c['name']}: {sorted(variables - accepted)}"
    assert checked >= 3  # the key Job, the gateway, the CPU worker


def _env(container: dict, replace: dict[str, str]) -> dict[str, str]:
    """A container's HYBRIDGATE_ variables with the cluster's names replaced by this machine's loopback."""
    env = {}
    for e in container.get("env", []):
        if "value" in e and e["name"].startswith("HYBRIDGATE_"):
            value = e["value"]
            for old, new in replace.items():
                value = value.replace(old, new)
            env[e["name"]] = value
    return env


def test_cpu_only_topology_serves_an_authenticated_chat_on_loopback(tmp_path, model_path):
    docs = render("cpu-only")
    by_name = {(n, c["name"]): c for n, c in containers(docs)}
    keys = tmp_path / "keys"
    keys.mkdir()
    # The key Job's generator, writing where the pods' init containers put the Secret's files.
    job = hybridgate_argv(by_name[("hybridgate-keys", "generate")])
    out = subprocess.run([HYBRIDGATE, *[a.replace("/work", str(keys)) for a in job]], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {p.name for p in keys.iterdir()} == {"deploy.key", "deploy.key.pub", "auth-token"}
    token = (keys / "auth-token").read_text().strip()
    redis = RedisServer(tmp_path)
    worker_port, grpc_port, http_port, metrics_port, worker_metrics = (free_port() for _ in range(5))
    replace = {"redis://redis:6379/0": redis.url, "/home/hybridgate/keys": str(keys), "0.0.0.0:5555": f"127.0.0.1:{worker_port}",
               "$(POD_IP):5555": f"127.0.0.1:{worker_port}", "0.0.0.0": "127.0.0.1", "50051": str(grpc_port),
               "8000": str(http_port), "9100": str(metrics_port), "9200": str(worker_metrics)}
    worker_c, gateway_c = by_name[("cpu-worker", "worker")], by_name[("gateway", "gateway")]
    procs = []
    try:
        worker = Proc([*hybridgate_argv(worker_c)], tmp_path / "worker.log",
                      env=_env(worker_c, replace) | {"HYBRIDGATE_THREADS": "1"})
        procs.append(worker)
        gateway = Proc([*hybridgate_argv(gateway_c)], tmp_path / "gateway.log", env=_env(gateway_c, replace))
        procs.append(gateway)
        worker.wait_for(r"hybridgate worker: READY", 120)
        endpoint = f"tcp://127.0.0.1:{worker_port}"  # the advertised address, as the pod IP would be
        gateway.wait_for(rf"cpu worker {endpoint}: \w+ → READY", 60)
        target = f"127.0.0.1:{grpc_port}"
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE["question"])]),
                                     max_tokens=len(FRANCE["ids"]), temperature=0)
        metadata = (("authorization", f"Bearer {token}"),)
        messages = list(stub(target).Generate(request, timeout=60 * TIME_FACTOR, metadata=metadata))
        assert [i for m in messages for i in m.token_ids] == FRANCE["ids"]
        scraped = metrics(f"http://127.0.0.1:{worker_metrics}/metrics")  # the worker's own, under vLLM's names
        assert any(k.startswith("vllm:kv_cache_usage_perc{model_name=") for k in scraped), sorted(scraped)
        import grpc

        with pytest.raises(grpc.RpcError) as refused:  # the token is required
            list(stub(target).Generate(request, timeout=30 * TIME_FACTOR))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for (name, cname), c in by_name.items():  # the readiness probes, pointed at these processes
            probe = c.get("readinessProbe", {}).get("exec", {}).get("command")
            if probe and probe[0] == "hybridgate":
                argv = [a.replace("127.0.0.1:5555", f"127.0.0.1:{worker_port}").replace("127.0.0.1:50051", target)
                        .replace("/home/hybridgate/keys", str(keys)) for a in probe[1:]]
                out = subprocess.run([HYBRIDGATE, *argv], capture_output=True, text=True, timeout=30 * TIME_FACTOR)
                assert out.returncode == 0, (name, out.stdout + out.stderr)
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as http_refused:  # the HTTP door takes the same token
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=30)
        assert http_refused.value.code == 401
    finally:
        for proc in procs:
            proc.stop()
        redis.stop()
