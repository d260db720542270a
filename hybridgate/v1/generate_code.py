"""Regenerate hybridgate/v1/*_pb2*.py from proto/ (needs grpcio-tools): `python -m hybridgate.v1.generate_code`."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("hybridgate/v1/generation.proto")


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under `out_dir/hybridgate/v1/`; return their paths."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + str(PROTO))
    return sorted((out_dir / "hybridgate" / "v1").glob("generation_pb2*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = ROOT / "hybridgate" / "v1" / path.name
            target.write_text(path.read_text())
            print("wrote", target.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
