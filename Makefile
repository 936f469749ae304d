# One-command set-up: `make demo` and `make test` create .venv (CPU stack, torch pinned to the CPU build) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# torch==2.13.0+cpu is not on PyPI: a machine whose pip already finds it (a local wheel folder, checked offline)
# installs from there; any other gets PyTorch's CPU wheel index too. Evaluated only when the venv is built.
TORCH_PIN := torch==2.13.0+cpu
TORCH_INDEX = $(shell $(PYTHON) -m pip install --dry-run --quiet --no-deps --no-index --ignore-installed "$(TORCH_PIN)" >/dev/null 2>&1 || echo "--extra-index-url https://download.pytorch.org/whl/cpu")
# Trainer and vLLM share 2 cores: spinning OpenMP workers would steal them from each other (measured: a small
# matmul 30x slower under load with the default policy).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv demo test test-fast matrix bench lint docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt $(TORCH_INDEX) -e ".[cpu,dev]"
	# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch and nothing here needs them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: venv
	$(BIN)/art-adapters demo

test: venv
	$(BIN)/python -m pytest -q -rs --ignore=tests/test_matrix.py $(PYTEST_ARGS)

# The framework matrix: third-party agent frameworks on vLLM, each in its environment (.venv-matrix/, made on
# first use); `python tests/matrix/table.py` then writes the docs' table from build/matrix.json.
matrix: venv
	$(BIN)/python -m pytest -q -rs tests/test_matrix.py $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -m "not vllm and not train" $(PYTEST_ARGS)

bench: venv
	$(BIN)/python bench/capture_overhead.py
	$(BIN)/python bench/rollout_throughput.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/fidelity.py
	$(BIN)/python bench/async_pipeline.py
	$(BIN)/python bench/replicas.py
	$(BIN)/python bench/production_import.py

# The documentation site, built strictly (a broken link or reference fails) into site/; its Python blocks run as
# tests in `make test` (tests/test_docs.py). The docs extra is installed on first use.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: venv
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

clean:
	rm -rf $(VENV) .venv-matrix .pytest_cache .ruff_cache site
