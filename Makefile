# The two entry points of the README. Each creates .venv with Python >= 3.12 if it is missing,
# installs the project into it, then runs.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

demo: $(VENV)/.installed-core
	$(PY) -m dllm_jax.cli demo

# Two workers (CI has 2 cores; each is a JAX process of 2-4 GB), whole files per worker so a file's
# module fixtures and compiled programs are made once, not once per worker.
test: $(VENV)/.installed-test
	$(PY) -m pytest -m "not gpu" -q -n 2 --dist loadfile

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
