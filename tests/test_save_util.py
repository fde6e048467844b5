from pathlib import Path

import pytest
from stable_baselines3 import PPO as StockPPO

from sb3_speedups.common.save_util import atomic_write, save_model


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path):
    target = tmp_path / "model.zip"
    target.write_bytes(b"old")

    def broken(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.zip"]


def test_save_model_appends_zip_and_loads(tmp_path: Path):
    model = StockPPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16)
    path = save_model(model, tmp_path / "sub" / "agent")
    assert path == tmp_path / "sub" / "agent.zip"
    assert StockPPO.load(path).n_steps == 16
    assert sorted(p.name for p in path.parent.iterdir()) == ["agent.zip"]
