#!/usr/bin/env bash
# `make gpu-check`: the GPU-marked tests and the GPU benchmark on a bare CUDA machine, in under 5 minutes.
#
# Needs python3 with torch (CUDA), transformers, pytest, numpy there. pyzmq, msgspec and gguf (and gguf's
# pyyaml, and llguidance) come as cp312 wheels in .gpu-wheels/ (`make gpu-wheels` here; carry the folder along).
# The 98 MB model does not travel: a random-weight GGUF of its shapes is written on the machine.
# Figures: $OUT/attention.json (bench attention), $OUT/gpu-check.json (bench engine), $OUT/gpu-tests.xml and
# $OUT/gpu-kernel-tests.xml (test reports; the hand-off's hidden copy fraction is printed by test_handoff_gpu.py).
# Not here (each alone fits another call): bench engine --constrained-fraction 0.5, bench handoff --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests/reference${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl
  export PYTHONPATH="$PWD/.gpu-site:$PYTHONPATH"
fi
MODEL=${HYBRIDGATE_GPU_CHECK_MODEL:-/tmp/hybridgate-random-135m.gguf}
if [ ! -f "$MODEL" ]; then
  $PY -c "import sys; from pathlib import Path; from tiny_gguf import write_default_shaped; write_default_shaped(Path(sys.argv[1]))" "$MODEL"
fi
export HYBRIDGATE_GPU_CHECK_MODEL="$MODEL"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
status=0
export TRITON_INTERPRET=0  # the kernels compiled for the GPU (the tests' conftest interprets them otherwise)
# Time limits sum to 300 s: a rerun fits in what a lent device allows.
timeout 100 $PY -m pytest -q -s tests/unit/test_gpu_kernels.py tests/unit/test_fused_kernels.py -p no:cacheprovider \
  --junitxml "$OUT/gpu-kernel-tests.xml" || status=$?
timeout 80 $PY -m pytest -q -s -m gpu tests/component/test_gpu.py tests/component/test_handoff_gpu.py \
  tests/component/test_architectures_gpu.py tests/component/test_constraints_gpu.py -p no:cacheprovider \
  --junitxml "$OUT/gpu-tests.xml" || status=$?
# Our paged attention against the gather+SDPA path and dense SDPA (Llama-3.1-8B's heads, bf16), with the copy
# bandwidth and matmul rate probed in the same run.
timeout 60 $PY -m hybridgate.cli bench attention --repeats 10 --json "$OUT/attention.json" || status=$?
timeout 60 $PY -m hybridgate.cli bench engine --kind gpu --device cuda --model "$MODEL" --concurrency 1,16,64 \
  --prefill-prompts 8 --prefill-lens 512,2048 --repeats 2 --json "$OUT/gpu-check.json" || status=$?
exit $status
