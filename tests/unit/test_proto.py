"""The committed generated code equals what protoc makes from proto/ today."""

from __future__ import annotations

import re
from pathlib import Path

from hybridgate.v1 import generate_code
from hybridgate.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
# Lines that carry the generator's own version; they differ between grpcio-tools releases.
_VERSION_LINE = re.compile(r"(Protobuf Python Version|GRPC_GENERATED_VERSION|_runtime_version\.ValidateProtobufRuntimeVersion"
                           r"|^\s+_runtime_version\.Domain\.PUBLIC,|^\s+\d+,\s*$|^\s+'',\s*$)")


def _normalized(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _VERSION_LINE.search(line)]


def test_generated_code_is_current(tmp_path):
    generated = generate_code.generate(tmp_path)
    assert {p.name for p in generated} == {"generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"}
    for path in generated:
        committed = ROOT / "hybridgate" / "v1" / path.name
        assert _normalized(committed.read_text()) == _normalized(path.read_text()), (
            f"{committed} is stale: run `python -m hybridgate.v1.generate_code`")


def test_enum_zero_values_mean_unspecified():
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")


def test_sampling_fields_are_optional():
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        assert fields[name].has_presence, name
