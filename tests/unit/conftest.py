"""tests/unit makes no engine and imports no torch: `test_layers.py:
test_the_unit_tests_import_no_torch` runs them where torch cannot be imported."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def block_accounting():
    """No engine here, so nothing to account (the suite's fixture of this name imports the engine)."""
    return []
