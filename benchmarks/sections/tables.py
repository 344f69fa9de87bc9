"""The table writer of the sections: `dllm_jax.bench.tables`, the one of every results file.

`throughput.py --baseline` runs the sections beside an old copy of the package (first on sys.path), whose
`dllm_jax.bench` is a module without it: the same file of this checkout is loaded then (it needs only the
standard library)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

try:
    from dllm_jax.bench.tables import cell, markdown_table
except ImportError:
    _path = Path(__file__).resolve().parents[2] / "dllm_jax" / "bench" / "tables.py"
    _spec = importlib.util.spec_from_file_location("throughput_tables", _path)
    _tables = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_tables)
    cell, markdown_table = _tables.cell, _tables.markdown_table

__all__ = ["cell", "markdown_table"]
