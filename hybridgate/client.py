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
    req = pb.GenerateRequest(stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    return req


def generate(args: argparse.Namespace, prompt: str) -> int:
    """Stream one request; text to stdout, a summary line (or errors) to stderr. 0 on success."""
    channel = grpc.insecure_channel(args.target)
    stub = pb_grpc.GenerationStub(channel)
    try:
        for msg in stub.Generate(build_request(args, prompt), timeout=args.timeout):
            if args.json:
                print(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True)), flush=True)
            else:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
            if msg.finish_reason:
                last = msg
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if not args.json:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"\n[finish_reason={reason} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens} ttft_ms={last.timings.ttft_ms:.1f} "
              f"total_ms={last.timings.total_ms:.1f} route={last.route}]", file=sys.stderr)
    return 0
