# The two entry points of the README. Each creates .venv with Python >= 3.12 if it is missing,
# installs the project into it, then runs.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

demo: $(VENV)/.installed-core
	$(PY) -m dllm_jax.cli demo

# Two workers (CI has 2 cores; each is a JAX process of 2-4 GB), whole files per worker (--dist loadfile) so a
# file's module fixtures and compiled programs are made once, not once per worker; the longest files first
# (tests/conftest.py's LONGEST_FIRST, not xdist's order by test count) so that both workers end together. Most of
# the suite's time is XLA:CPU compiling small programs: LLVM at -O0 (TEST_XLA_FLAGS) cuts the compile-bound files
# by about a quarter; the notebooks run as users run them, without it (tests/test_notebooks.py).
# JAX's persistent compilation cache (.cache/jax) keeps every compiled program, keyed by its HLO, flags and
# jax version: the test files each clear the in-memory cache (tests/conftest.py), so a program two files
# (or both workers, or a test's subprocess) compile is built once. On a fresh clone that saves about 5% of the
# suite's time; a rerun with the package unchanged finds nearly everything cached and takes about half as long.
# Entries older than 7 days are deleted before each run, which bounds the cache's size (programs of code since
# changed are never read again) without JAX's own size limit: that rescans the whole directory on every write and
# makes the suite slower than no cache at all.
TEST_XLA_FLAGS := --xla_backend_optimization_level=0
TEST_JAX_CACHE := JAX_COMPILATION_CACHE_DIR="$(CURDIR)/.cache/jax" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
test: $(VENV)/.installed-test
	mkdir -p .cache/jax && find .cache/jax -type f -mtime +7 -delete
	$(TEST_JAX_CACHE) XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" TEST_XLA_FLAGS="$(TEST_XLA_FLAGS)" \
		$(PY) -m pytest -m "not gpu" -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

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
	rm -rf $(VENV) *.egg-info .cache/jax
