"""Executes the notebooks in place, saving their outputs (how the committed copies got their GPU outputs):

    PYTHONPATH=$PWD python scripts/run_notebooks.py [notebooks/NAME.ipynb ...]

Each runs top to bottom in a fresh kernel started in notebooks/; a failing cell stops with the error.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

root = Path(__file__).resolve().parent.parent
paths = [Path(p) for p in sys.argv[1:]] or sorted((root / "notebooks").glob("*.ipynb"))
for path in paths:
    start = time.perf_counter()
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=1200, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(notebook, path)
    print(f"{path}: {len(notebook.cells)} cells executed in {time.perf_counter() - start:.1f} s", flush=True)
