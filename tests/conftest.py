from pathlib import Path

import pytest


@pytest.fixture
def log_folder(tmp_path: Path) -> Path:
    """A fresh log folder."""
    return tmp_path / "logs"
