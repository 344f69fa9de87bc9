"""The notebooks' code cells run as written (shell lines excepted), so the docs stay true."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_code_cells_run(path):
    cells = json.loads(path.read_text())["cells"]
    namespace = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            source = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
            exec(compile(source, f"{path.name}", "exec"), namespace)
    assert namespace["logits"].shape == (2, 64, namespace["config"].vocab_size)
