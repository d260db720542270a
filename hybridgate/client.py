"""`hybridgate generate`: a small synchronous gRPC client that prints as text arrives."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format

from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace, prompt: str) -> pb.GenerateRequest:
    """The request of the command line. Raises ValueError naming a flag whose value the proto cannot hold."""
    # the gateway's limits where they are narrower than the proto's field (max_tokens >= 1, top_k >= -1)
    for flag, value, low, high in (("--max-tokens", args.max_tokens, 1, 2**32 - 1), ("--seed", args.seed, 0, 2**64 - 1),
                                   ("--top-k", args.top_k, -1, 2**31 - 1)):
        if value is not None and not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")
    req = pb.GenerateRequest(stop=args.stop, ignore_eos=args.ignore_eos)
    if not getattr(args, "skip_special_tokens", True):
        req.skip_special_tokens = False
    if args.chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "route"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    if getattr(args, "request_model", None) is not None:
        req.model = args.request_model
    return req


def gateway_target(args: argparse.Namespace) -> str:
    """`--target`, or else where the gateway of these settings listens (--host, --port, their HYBRIDGATE_*
    variables or the --config file, as `serve` reads them), a wildcard host as this machine's loopback.
    Raises ValueError naming --port when it is 0 (serve's free port: only its `gRPC on` line says which)."""
    if args.target:
        return args.target
    from hybridgate.config import resolve

    gateway = resolve(args).settings.gateway
    if gateway.port == 0:
        raise ValueError("--port: 0 lets serve pick a free port; give the port it printed (--port, "
                         "HYBRIDGATE_PORT or --target HOST:PORT)")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(gateway.host, gateway.host)
    return f"[{host}]:{gateway.port}" if ":" in host else f"{host}:{gateway.port}"


def open_channel(target: str, tls_ca: str | None) -> grpc.Channel:
    """A channel to `target`: TLS trusting the PEM file `tls_ca` when given, else plaintext.
    Raises OSError naming --tls-ca when the file cannot be read."""
    if tls_ca is None:
        return grpc.insecure_channel(target)
    try:
        with open(tls_ca, "rb") as f:
            roots = f.read()
    except OSError as exc:
        raise OSError(f"--tls-ca: cannot read {tls_ca}: {exc.strerror or exc}") from None
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


def generate(args: argparse.Namespace, prompt: str) -> int:
    """Stream one request; text to stdout, a summary line (or errors) to stderr. 0 on success."""
    request = build_request(args, prompt)
    channel = open_channel(gateway_target(args), getattr(args, "tls_ca", None))
    stub = pb_grpc.GenerationStub(channel)
    token = getattr(args, "auth_token", None)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    wrote = False
    call = stub.Generate(request, timeout=args.timeout, metadata=metadata)
    try:
        for msg in call:
            if args.json:
                fields = json_format.MessageToDict(msg, preserving_proto_field_name=True)
                fields.setdefault("token_index", msg.token_index)  # proto3 leaves out a 0
                print(json.dumps(fields), flush=True)
            else:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                wrote = wrote or bool(msg.text)
            if msg.finish_reason:
                last = msg
        if args.json:  # the placement: plan, policy, predicted and observed TTFT
            print(json.dumps({"trailing_metadata": dict(call.trailing_metadata() or ())}), flush=True)
    except grpc.RpcError as exc:
        if wrote:
            print()
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if not args.json:
        print(flush=True)  # the answer before the stats line, also when both go to one pipe
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"[finish_reason={reason} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens} ttft_ms={last.timings.ttft_ms:.1f} "
              f"total_ms={last.timings.total_ms:.1f} route={last.route}]", file=sys.stderr)
    return 0
