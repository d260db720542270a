"""The committed generated code equals what protoc makes from proto/ today."""

from __future__ import annotations

from pathlib import Path

from conftest import generated_code_lines
from hybridgate.v1 import generate_code
from hybridgate.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    generated = generate_code.generate(tmp_path)
    assert {p.name for p in generated} == {"generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"}
    for path in generated:
        committed = ROOT / "hybridgate" / "v1" / path.name
        assert generated_code_lines(committed.read_text()) == generated_code_lines(path.read_text()), (
            f"{committed} is stale: run `python -m hybridgate.v1.generate_code`")


def test_enum_zero_values_mean_unspecified():
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")


def test_sampling_fields_are_optional():
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        assert fields[name].has_presence, name
