"""Writes tests/golden/inferencepool_v1_schema.json: the OpenAPI v3 schema of the Gateway API Inference
Extension's InferencePool (inference.networking.k8s.io/v1), as its CustomResourceDefinition declares it.

Provenance: github.com/kubernetes-sigs/gateway-api-inference-extension, tag v1.6.0 (commit
992e5c292afb248801ce8d9234eb5b9d28eea231), config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
(Apache License 2.0). The schema is kept as the CRD has it (descriptions included), under the version's
`schema.openAPIV3Schema`, so that a test validates an InferencePool manifest with jsonschema offline (no
cluster, and kubernetes-validate does not know this CRD).

    git show v1.6.0:config/crd/bases/inference.networking.k8s.io_inferencepools.yaml > crd.yaml
    python tests/reference/make_inferencepool_schema.py crd.yaml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "golden" / "inferencepool_v1_schema.json"


def main(crd_path: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = {"source": "gateway-api-inference-extension v1.6.0 (992e5c292afb248801ce8d9234eb5b9d28eea231), "
                        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
              "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": "v1",
              "openAPIV3Schema": version["schema"]["openAPIV3Schema"]}
    OUT.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main(sys.argv[1])
