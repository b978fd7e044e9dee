# nsa-dist: `make demo` runs the main job on the embedded default, `make test` the tests but the slow ones
# (under 10 minutes on 2 cores), `make test-all` every test (what CI runs: .ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# two pytest workers, tests dealt one by one; on each the Ray-cluster modules come last
# (tests/conftest.py), so each worker starts the embedded Ray once (TEST_WORKERS=0: one process)
TEST_WORKERS ?= 2

.PHONY: install demo test test-slow test-all lint format bench bench-layouts bench-full-size clean

install: $(VENV)/.installed

# Torch first, by hand: with no NVIDIA GPU take the CPU wheel (found locally when a wheel
# directory provides it, else from PyTorch's CPU index), so the range in pyproject.toml is
# already satisfied and pip pulls no CUDA build.  With a GPU, the default (CUDA) wheel + CuPy.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing CUDA torch and the gpu extra"; \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)" && \
	  $(PY) -m pip install -q -e ".[test,lint,gpu]"; \
	else \
	  echo "no NVIDIA GPU: installing the CPU build of torch"; \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX); \
	  $(PY) -m pip install -q -e ".[test,lint]"; \
	fi
	touch $@

demo: install
	$(PY) -m nsa_dist.demo

# ruff's rules and import-linter's contracts are in pyproject.toml; CI runs them through `make test-all`
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# ruff's safe fixes (import order, pyupgrade), then the formatter
format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# `slow`: multi-process tests and those tests/slow.txt names (measured above 6 s); test-all runs them too
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
test: install lint
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(XDIST) $(PYTEST_ARGS)

test-all: install lint
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# nngeometry (benchmark (d) only) declares torchvision, which would drag in another torch build;
# it never imports it, so it is installed without dependencies.
bench: install
	$(PY) -m pip install -q --no-deps "nngeometry==0.4"
	$(PY) benchmarks/ntk_gram.py
	$(PY) benchmarks/sweep.py
	$(PY) benchmarks/hessian.py
	$(PY) benchmarks/ntk_models.py --parts ab --n-resnet 2000 --n-small 500 --batch 250 500 --jacobian-cached

# Issue 8's layouts: (a) block_rows on 2 and 4 workers vs local at N = 30,000, (d) the Hessian over
# 2 shards vs 1; (b) N = 60,000 and (c) matrix_free at N = 200,000 take long: run them by hand.
bench-layouts: install
	$(PY) benchmarks/layouts.py a
	$(PY) benchmarks/layouts.py d

# Issue 19: the full-size recipes (MNIST N = 60,000; CIFAR-10 N = 50,000 with the CNN factory) on
# stand-in files in the real formats, block_rows on 4 gang members, three recorded steps each.
bench-full-size: install
	$(PY) benchmarks/full_size.py mnist --steps 3
	$(PY) benchmarks/full_size.py cifar10 --steps 3

clean:
	rm -rf $(VENV) nsa-results.zarr demo-out bench-out

# The model zoo: every torchvision classification model (tiny configurations where the default is
# too large) and tiny Hugging Face transformers, gram() against a float64 torch.func.jacrev
# reference; its table is in benchmarks/README.md. Its own venv: torchvision needs another torch
# build than the CPU one above. Never part of `make test` / `make test-all`.
ZOO_VENV ?= .venv-zoo
.PHONY: zoo
zoo: $(ZOO_VENV)/.installed
	$(ZOO_VENV)/bin/python benchmarks/zoo.py

$(ZOO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 transformers
	$(ZOO_VENV)/bin/pip install -q -e .
	touch $@
