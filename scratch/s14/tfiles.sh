# pytest time of the given test files under make test's flags, no persistent cache (a fresh clone's first run)
XLA_FLAGS="--xla_backend_optimization_level=0" TEST_XLA_FLAGS="--xla_backend_optimization_level=0" \
  .venv/bin/python -m pytest -q -m "not gpu" -p no:cacheprovider "$@" 2>&1 | tail -1
