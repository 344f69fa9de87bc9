# The two entry points of the README. Each creates .venv with Python >= 3.12 if it is missing,
# installs the project into it, then runs.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

demo: $(VENV)/.installed-core
	$(PY) -m dllm_jax.cli demo

# Two workers (CI has 2 cores; each is a JAX process of 2-4 GB), whole files per worker so a file's
# module fixtures and compiled programs are made once, not once per worker. Most of the suite's time is
# XLA:CPU compiling small programs: LLVM at -O0 (TEST_XLA_FLAGS) cuts the compile-bound files by about a
# quarter (measured per file, 2026-11-26); the notebooks run as users run them, without it
# (tests/test_notebooks.py).
TEST_XLA_FLAGS := --xla_backend_optimization_level=0
test: $(VENV)/.installed-test
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" TEST_XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -m "not gpu" -q -n 2 --dist loadfile

$(PY):
	"$$(scripts/find-python)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-core: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV)/.installed-core $@

clean:
	rm -rf $(VENV) *.egg-info
