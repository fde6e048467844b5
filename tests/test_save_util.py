import os
import stat
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


def test_saved_files_get_the_mode_of_an_ordinary_write(tmp_path: Path):
    from sb3_speedups.zoo.runs import write_yaml

    previous = os.umask(0o022)
    try:
        model = StockPPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16)
        written = [save_model(model, tmp_path / "agent"), write_yaml(tmp_path / "config.yml", {"a": 1})]
        written.append(atomic_write(tmp_path / "plot.png", lambda tmp: tmp.write_bytes(b"png")))
        model.save(tmp_path / "stock.zip")
        os.umask(0o077)
        private = atomic_write(tmp_path / "private.csv", lambda tmp: tmp.write_text("x"))
    finally:
        os.umask(previous)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {p.name: 0o644 for p in written}
    assert stat.S_IMODE((tmp_path / "stock.zip").stat().st_mode) == 0o644  # what SB3's own save gives
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
