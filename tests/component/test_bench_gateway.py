"""`hybridgate bench gateway` on a tiny case: real instant worker, gateway and client processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TIME_FACTOR

HYBRIDGATE = str(Path(sys.executable).parent / "hybridgate")


def test_bench_gateway_reports_every_figure(tmp_path):
    out = tmp_path / "gateway.json"
    proc = subprocess.run([HYBRIDGATE, "bench", "gateway", "--concurrency", "1,3", "--requests", "6",
                           "--max-tokens", "48", "--step-ms", "2", "--tls", "--repeats", "1",
                           "--large-chat-bytes", "20000", "--json", str(out)],
                          capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["protocol"] == "grpc"
    # --tls: each concurrency against plaintext, then TLS + auth, and their ratio
    assert [(r["concurrency"], r["tls"]) for r in report["results"]] == [(1, False), (1, True), (3, False), (3, True)]
    assert [r["concurrency"] for r in report["tls_ratios"]] == [1, 3]
    assert all(r["ratio"] > 0 and r["runs"] == 1 for r in report["tls_ratios"])
    for row in report["results"]:
        # Every stream ran to max_tokens (ignore_eos): 6 streams x 48 ids, none cut short. (2 ms steps:
        # enough gateway work that its CPU time is more than a clock tick, 10 ms, on a quiet machine.)
        assert row["tokens"] == 6 * 48 and row["errors"] == 0 and row["short_streams"] == 0
        assert 1 / 48 <= row["messages_per_token"] <= 1
        for key in ("tokens_per_s", "gateway_cpu_s", "gateway_cpu_us_per_token", "worker_cpu_us_per_token",
                    "client_cpu_us_per_token"):
            assert row[key] > 0, key
        # --large-chat-bytes: chats of 20,000 and 10,000 bytes arrived meanwhile (tokenized in the prompt
        # processes: fine for the model, so answered OK), and the loop's lag was read over the run
        assert sum(row["large_chats"].values()) >= 1 and set(row["large_chats"]) <= {
            "20000 bytes: OK", "10000 bytes: OK"}, row["large_chats"]
        lag = row["event_loop_lag"]
        assert lag["probes"] > 0 and 0 <= lag["within_20ms"] <= 1 and lag["p99_ms_at_most"] <= lag["max_ms_at_most"]
        for key in ("ttft_ms", "itl_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p90"] <= row[key]["p99"], key
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert report["machine"]["isa"] == ("avx512" if " avx512bw" in flags else "avx2" if " avx2" in flags else "other")
    assert report["machine"]["cpus"] == os.cpu_count() and "machine: " in proc.stdout
    assert "tokens/s" in proc.stdout and "µs CPU/token" in proc.stdout


def test_bench_gateway_over_both_doors_profiled(tmp_path):
    out, prof = tmp_path / "gateway-doors.json", tmp_path / "gateway.pstats"
    proc = subprocess.run([HYBRIDGATE, "bench", "gateway", "--protocol", "grpc,openai", "--concurrency", "2",
                           "--requests", "4", "--max-tokens", "32", "--step-ms", "2", "--profile", str(prof),
                           "--json", str(out)], capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["protocol"] == "grpc,openai" and "[OpenAI HTTP]" in proc.stdout
    assert report["auth"] is True and report["response_cache"] == "off"
    # The doors alternately on one gateway, both with the bearer token (a call without it would be an error).
    assert [r["protocol"] for r in report["results"]] == ["grpc", "openai"]
    for row in report["results"]:
        # Tokens from each stream's last message (gRPC) or usage chunk (HTTP): 4 streams x 32, none cut short.
        assert row["auth"] and row["tokens"] == 4 * 32 and row["errors"] == 0 and row["short_streams"] == 0
        assert 1 / 32 <= row["messages_per_token"] <= 1
        assert row["gateway_cpu_us_per_token"] > 0 and row["tokens_per_s"] > 0
        for key in ("ttft_ms", "itl_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p90"] <= row[key]["p99"], key
    # One line and one summary per door, the median of its runs (one run each here).
    by_door = {d["protocol"]: d for d in report["doors"]}
    for row in report["results"]:
        assert by_door[row["protocol"]]["gateway_cpu_us_per_token"] == row["gateway_cpu_us_per_token"]
        assert by_door[row["protocol"]]["runs"] == 1
    lines = [line for line in proc.stdout.splitlines() if line.startswith("per streamed token, ")]
    assert len(lines) == 2 and "gRPC" in lines[0] and "OpenAI HTTP" in lines[1]
    assert all("auth on, response cache off" in line for line in lines)
    # The profile covers the measured runs: both doors' handlers ran while it was on.
    import pstats

    names = {(Path(file).name, name) for file, _, name in pstats.Stats(str(prof)).stats}
    assert ("service.py", "Generate") in names and ("http.py", "_sse") in names


def test_bench_gateway_tools_compares_chats_with_and_without_a_tool(tmp_path):
    out = tmp_path / "gateway-tools.json"
    proc = subprocess.run([HYBRIDGATE, "bench", "gateway", "--tools", "--protocol", "openai", "--concurrency", "2",
                           "--requests", "2", "--max-tokens", "96", "--step-ms", "2", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [r["tools"] for r in report["results"]] == [False, True] and "[chat with tools]" in proc.stdout
    for row in report["results"]:
        assert row["tokens"] == 2 * 96 and row["errors"] == 0 and row["short_streams"] == 0
    # 96 ids of the recorded generation (92 ids, two calls) hold two whole calls per stream, parsed by the gateway
    assert report["results"][0]["tool_calls"] == 0 and report["results"][1]["tool_calls"] >= 2 * 2
    (ratio,) = report["tools_ratios"]
    assert ratio["concurrency"] == 2 and ratio["gateway_cpu_ratio"] > 0 and ratio["runs"] == 1


def test_bench_gateway_grpc_floor_beside_the_door_coalescing_on_and_off(tmp_path):
    out = tmp_path / "floor.json"
    proc = subprocess.run([HYBRIDGATE, "bench", "gateway", "--concurrency", "2", "--requests", "4",
                           "--max-tokens", "32", "--step-ms", "2", "--grpc-floor", "--coalesce", "on,off",
                           "--json", str(out)], capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    floor = report["grpc_floor"]
    (run,) = floor["runs"]
    # The bare server streamed every id, one a message, paced by its one step timer: 4 streams two at a
    # time, 32 steps of 2 ms each, so at least 2 x 32 x 2 ms of wall time.
    assert run["messages"] == 4 * 32 and run["errors"] == 0
    assert run["wall_s"] >= 2 * 32 * 0.002
    assert run["cpu_us_per_message"] > 0 and 0 <= run["system_us_per_message"] <= run["cpu_us_per_message"]
    # One gateway per mode, side by side; coalescing off sends one message per worker step, one id each.
    assert [(r["coalesce"], r["stream_interval"]) for r in report["results"]] == [(True, 1), (False, 1)]
    off = report["results"][1]
    assert off["messages"] == off["tokens"] == 4 * 32
    assert abs(off["gateway_cpu_us_per_message"] - off["gateway_cpu_s"] / (4 * 32) * 1e6) < 1e-6
    doors = {d["coalesce"]: d for d in report["doors"]}
    assert [s["coalesce"] for s in floor["summary"]] == [True, False]
    for summary in floor["summary"]:
        door = doors[summary["coalesce"]]
        assert summary["floor_cpu_us_per_message"] == run["cpu_us_per_message"]
        # above the floor per message, and per token less the floor's cost of the door's messages per token
        assert abs(summary["gateway_less_floor_us_per_message"]
                   - (door["gateway_cpu_us_per_message"] - run["cpu_us_per_message"])) < 1e-9
        assert abs(summary["gateway_less_floor_us"] - (door["gateway_cpu_us_per_token"]
                                                       - run["cpu_us_per_message"] * door["messages_per_token"])) < 1e-9
    assert "bare grpc.aio server at concurrency 2, step 2 ms" in proc.stdout
    assert "coalescing off: " in proc.stdout and "coalescing on: " in proc.stdout


def test_bench_gateway_grpc_floor_needs_one_message_per_token():
    proc = subprocess.run([HYBRIDGATE, "bench", "gateway", "--grpc-floor"], capture_output=True, text=True,
                          timeout=60 * TIME_FACTOR)
    assert proc.returncode != 0 and "--grpc-floor" in proc.stderr + proc.stdout and "--step-ms" in proc.stderr + proc.stdout
