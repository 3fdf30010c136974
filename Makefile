# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# numpy is installed beside torch: without it every torch process warns "Failed to initialize
# NumPy" (the demo's server, the agent's tests).

.PHONY: install demo test lint typecheck test-gpu bench clean

$(VENV)/.installed: pyproject.toml setup.py Makefile watchdog/agent/_hotpath.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy
	$(PY) -m pip install -q -e ".[agent,test,serve]"
	touch $@

install: $(VENV)/.installed

# torch-watchdog demo: the server, the agent and the real sidecar, end to end (on CPU: timings
# with their date and machine in benchmarks/results/demo.md)
demo: install
	$(PY) -m torch_watchdog.cli demo

# ruff over the whole tree (pyproject.toml, [tool.ruff])
lint: install
	$(PY) -m ruff check watchdog tests benchmarks examples

test: install lint typecheck
	$(PY) -m pytest -q --durations=30 tests

# mypy --strict on the whole sidecar, the event schema and the agent's modules below (the
# package and those that never import torch; the agent's others, and torch itself, are not
# checked: pyproject.toml, [tool.mypy]). mypy needs the source folder named like the package
# (watchdog/ is imported as torch_watchdog): a symlink in .mypy-src/ (git-ignored)
AGENT_TYPED := auto calls config crashes drain emitter forks identity imports inflight serve \
               pools settings shapes signature warm
typecheck: install
	mkdir -p .mypy-src && ln -sfn ../watchdog .mypy-src/torch_watchdog
	MYPYPATH=.mypy-src $(PY) -m mypy --strict -p torch_watchdog.sidecar -p torch_watchdog.events \
	  -m torch_watchdog.agent $(addprefix -m torch_watchdog.agent.,$(AGENT_TYPED))

# On a machine with a CUDA GPU and torch already installed (see docs/gpu-tests.md).
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests/gpu

bench: install
	$(PY) benchmarks/agent_overhead.py

clean:
	rm -rf $(VENV) *.egg-info
