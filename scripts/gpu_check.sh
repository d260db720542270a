#!/usr/bin/env bash
# `make gpu-check`: on a bare CUDA machine, in one call: bench engine on the Llama-3.2-1B and Llama-3.1-8B shapes
# (random bf16 weights made on the device; the copy bandwidth, the matmul rate, the decode step against its memory
# bound, tokens/s against transformers, prefill, the mixed step and the hand-off's hidden copy), then the GPU tests
# (the paged attention kernels compiled for the GPU, and the tests marked gpu: runner, hand-off export, every
# family, constraints). Ends with one `summary:` line per figure and per test file.
#
# Needs python3 with torch (CUDA), transformers, pytest, hypothesis and numpy there, and no network. pyzmq,
# msgspec, gguf (with its pyyaml) and llguidance come as cp312 wheels in .gpu-wheels/ (`make gpu-wheels` here; the
# folder is git-ignored, so carry it along). Nothing large travels: the benches make their weights on the device,
# and the tests' 135M-shaped GGUF is written there with random weights.
# JSON: under $OUT when it is set (the folder the caller collects from the machine), else under docs/results/,
# as gpu-engine/DATE-DEVICE-SHAPE.json (`hybridgate bench report` renders them into docs/benchmarks/gpu-worker.md);
# the four logs beside them under $OUT, else under gpu-check-out/: six files, as a lent machine hands back at most
# eight (tests/unit/test_gpu_check_script.py counts them).
# Every command runs under a time limit; the limits sum to 270 s (tests/unit/test_gpu_check_script.py), so the whole
# check and one rerun fit in ten minutes of a GPU. The benches come first: their figures matter most.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-docs/results}/gpu-engine
DAY=$(date -u +%F)
LOGS=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
mkdir -p "$DEST" "$LOGS"
export PYTHONPATH="$PWD:$PWD/tests/reference${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # the kernels compiled for the GPU (the tests' conftest interprets them otherwise)
status=0
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  timeout 15 $PY -m pip install -q --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl || status=$?
  export PYTHONPATH="$PWD/.gpu-site:$PYTHONPATH"
fi
DEVICE=$(timeout 10 $PY -c "import re, torch; n = torch.cuda.get_device_name(0); print(torch.__version__, n, file=__import__('sys').stderr); print(re.sub('[^a-z0-9]+', '-', n.lower().removeprefix('nvidia ')).strip('-'))") || status=$?
DEVICE=${DEVICE:-unknown}
# Llama-3.2-1B: every concurrency, transformers beside at the two the issue sets a target for.
timeout 85 $PY -m hybridgate.cli bench engine --kind gpu --shape llama-3.2-1b --repeats 2 \
  --baseline-concurrency 64,256 --json "$DEST/$DAY-$DEVICE-llama-3.2-1b.json" \
  > "$LOGS/bench-llama-3.2-1b.log" 2>&1 || status=$?
# Llama-3.1-8B: the memory-bound step, prefill at 8k, the mixed step, the hand-off, 1 and 64 sequences; no
# transformers and no 256 sequences (the issue's transformers target is on the 1B shape; their seconds go there).
timeout 60 $PY -m hybridgate.cli bench engine --kind gpu --shape llama-3.1-8b --repeats 2 --concurrency 1,64 \
  --baseline none --json "$DEST/$DAY-$DEVICE-llama-3.1-8b.json" \
  > "$LOGS/bench-llama-3.1-8b.log" 2>&1 || status=$?
MODEL=${HYBRIDGATE_GPU_CHECK_MODEL:-/tmp/hybridgate-random-135m.gguf}
if [ ! -f "$MODEL" ]; then
  timeout 10 $PY -c "import sys; from pathlib import Path; from tiny_gguf import write_default_shaped; write_default_shaped(Path(sys.argv[1]))" "$MODEL" || status=$?
fi
export HYBRIDGATE_GPU_CHECK_MODEL="$MODEL"
timeout 45 $PY -m pytest -q -p no:cacheprovider tests/unit/test_gpu_kernels.py tests/unit/test_fused_kernels.py \
  > "$LOGS/tests-gpu-kernels.log" 2>&1 || status=$?
timeout 45 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/component/test_gpu.py tests/component/test_handoff_gpu.py \
  tests/component/test_architectures_gpu.py tests/component/test_constraints_gpu.py tests/component/test_moe.py \
  > "$LOGS/tests-gpu.log" 2>&1 || status=$?
grep -h '^summary:' "$LOGS"/bench-*.log
for log in "$LOGS"/tests-*.log; do
  echo "summary: $(basename "$log" .log): $(grep -E '(passed|failed|error|skipped|no tests ran)' "$log" | tail -1)"
done
for log in "$LOGS"/bench-*.log; do
  grep -q '^summary:' "$log" || { echo "summary: $(basename "$log" .log) wrote no figures; its last lines:"; tail -5 "$log"; }
done
echo "summary: exit status $status (0: every step finished in its time)"
exit $status
