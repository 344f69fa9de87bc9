import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # torch_reference.py


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible across runs, not shared)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
