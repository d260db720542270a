"""deploy/kubernetes/inference-extension/inferencepool.yaml: valid against the InferencePool CRD's own
OpenAPI schema (inference.networking.k8s.io/v1, tests/golden/inferencepool_v1_schema.json, provenance in
tests/reference/make_inferencepool_schema.py), no field the schema does not know (the API server would
prune it silently), and selecting the rendered overlays' gateway pods on their HTTP port."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from conftest import ROOT, golden_json
from test_kubernetes import OVERLAYS, render

SCHEMA = golden_json("inferencepool_v1_schema.json")
POOL = yaml.safe_load((ROOT / "deploy/kubernetes/inference-extension/inferencepool.yaml").read_text())


def unknown_fields(value, schema: dict, where: str = "") -> list[str]:
    """Paths in `value` that `schema` declares no property for (objects without additionalProperties)."""
    if isinstance(value, dict) and "properties" in schema:
        out = []
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f"{where}.{key}")
            else:
                out += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
        return out
    if isinstance(value, list) and "items" in schema:
        return [p for i, item in enumerate(value) for p in unknown_fields(item, schema["items"], f"{where}[{i}]")]
    return []


def test_the_pool_matches_the_crd_schema():
    assert (POOL["apiVersion"], POOL["kind"]) == (f"{SCHEMA['group']}/{SCHEMA['version']}", SCHEMA["kind"])
    jsonschema.Draft7Validator(SCHEMA["openAPIV3Schema"]).validate(POOL)
    assert unknown_fields(POOL, SCHEMA["openAPIV3Schema"]) == []
    picker = POOL["spec"]["endpointPickerRef"]  # the CRD's CEL rule: a Service reference names its port
    assert picker.get("kind", "Service") != "Service" or "port" in picker


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_selects_the_gateway_pods_on_their_http_port(overlay):
    docs = render(overlay)
    wanted = POOL["spec"]["selector"]["matchLabels"]
    selected = [d for d in docs if d["kind"] == "Deployment"
                and wanted.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert [d["metadata"]["name"] for d in selected] == ["gateway"]
    [container] = selected[0]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert [p["number"] for p in POOL["spec"]["targetPorts"]] == [ports["http"]] == [int(env["HYBRIDGATE_HTTP_PORT"])]
