#!/usr/bin/env bash
# `make gpu-check`: the GPU-marked tests and the GPU benchmark on a bare CUDA machine, in under 5 minutes.
#
# Needs python3 with torch (CUDA), transformers, pytest, numpy there. pyzmq, msgspec and gguf (and gguf's
# pyyaml, and llguidance) come as cp312 wheels in .gpu-wheels/ (`make gpu-wheels` here; carry the folder along).
# The 98 MB model does not travel: a random-weight GGUF of its shapes is written on the machine.
# Figures: $OUT/gpu-check.json (benchmark), $OUT/gpu-tests.xml (test report; the hand-off's hidden copy
# fraction is printed by test_handoff_gpu.py), $OUT/handoff.json (bench handoff, where numba is installed).
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
timeout 240 $PY -m pytest -q -s -m gpu tests/component/test_gpu.py tests/component/test_handoff_gpu.py \
  tests/component/test_architectures_gpu.py tests/component/test_constraints_gpu.py -p no:cacheprovider \
  --junitxml "$OUT/gpu-tests.xml" || status=$?
timeout 150 $PY -m hybridgate.cli bench engine --kind gpu --device cuda --model "$MODEL" --concurrency 1,4,16,64 \
  --prefill-prompts 16 --prefill-lens 128,512,2048 --repeats 3 --compare-eager --json "$OUT/gpu-check.json" || status=$?
# What constraints cost on CUDA: 16 sequences, 8 of them JSON-schema constrained, against none.
timeout 120 $PY -m hybridgate.cli bench engine --kind gpu --device cuda --model "$MODEL" --constrained-fraction 0.5 \
  --repeats 3 --json "$OUT/constrained.json" || status=$?
# The KV hand-off end to end (GPU worker on CUDA, CPU worker on Numba) where numba is installed.
if $PY -c "import numba" 2>/dev/null; then
  timeout 240 $PY -m hybridgate.cli bench handoff --device cuda --model "$MODEL" --lengths 512,2048 --repeats 2 \
    --json "$OUT/handoff.json" || status=$?
fi
exit $status
