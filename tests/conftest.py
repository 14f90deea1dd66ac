import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def p2ptrain_cmd() -> list[str]:
    return [sys.executable, "-m", "p2ptrain"]
