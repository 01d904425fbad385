# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv with the standard library's venv if it is missing.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch used on laptops and CI. On a GPU machine: make TORCH_SPEC='torch==2.14.0' ...
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint install install-dev clean ui

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/sao demo

# The Prefect UI on http://127.0.0.1:4200 with the flows served (sao/ui_cli.py); Ctrl-C stops it.
ui: install
	$(VENV)/bin/sao ui

lint: install-dev
	$(VENV)/bin/ruff check .

# pytest's exit status is kept in .pytest-rc so that .ci/run can tell "no tests" (5) apart.
test: lint
	@rm -f .pytest-rc
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

# The slow tier (tests marked `slow`: the crash harness, the benchmarks' quick runs, the largest
# end-to-end runs; see docs/TESTING.md); .ci/run runs it after `make test`.
test-slow: install-dev
	@rm -f .pytest-rc
	$(PY) -m pytest -m 'slow and not vllm and not gpu' $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache .pytest-rc .ruff_cache
