import json
import subprocess
import sys
import time

import pytest

from sb3_speedups.bench.core import BenchConfig, plan_runs, summarize
from sb3_speedups.bench.report import format_table
from sb3_speedups.bench.memory import PeakMemory, tree_pss_mb
from sb3_speedups.cli import main
from sb3_speedups.errors import UserError


def test_runs_alternate_abba():
    runs = plan_runs(BenchConfig("ppo", "CartPole-v1", seeds=[0, 1, 2], variants=["ours", "stock"], ours_conf_file="x.yml"))
    assert [(r.variant, r.seed) for r in runs] == [
        ("ours", 0),
        ("stock", 0),
        ("stock", 1),
        ("ours", 1),
        ("ours", 2),
        ("stock", 2),
    ]
    assert {r.conf_file for r in runs if r.variant == "ours"} == {"x.yml"}
    assert {r.conf_file for r in runs if r.variant == "stock"} == {None}
    with pytest.raises(UserError, match="unknown benchmark variant"):
        plan_runs(BenchConfig("ppo", "CartPole-v1", variants=["ours", "fastest"]))


def test_a_variant_can_choose_its_vec_env():
    runs = plan_runs(BenchConfig("ppo", "CartPole-v1", seeds=[0], variants=["ours@batched", "ours@dummy", "stock"]))
    assert [(r.variant, r.vec_env) for r in runs] == [("ours@batched", "batched"), ("ours@dummy", "dummy"), ("stock", "dummy")]
    with pytest.raises(UserError, match="unknown VecEnv"):
        plan_runs(BenchConfig("ppo", "CartPole-v1", variants=["ours@fastest"]))
    with pytest.raises(UserError, match="repeat"):
        plan_runs(BenchConfig("ppo", "CartPole-v1", variants=["ours", "ours"]))
    records = [_record("ours@batched", s, to_target=s) for s in (1.0, 2.0)] + [
        _record("ours@dummy", s, to_target=s) for s in (3.0, 5.0)
    ]
    summary = summarize(records, ["ours@batched", "ours@dummy"])
    assert summary["reference"] == "ours@batched" and summary["speedup"]["ours@dummy"] == pytest.approx(4.0 / 1.5)
    assert "| ours@batched | " in format_table(summary) and "| 2.67x |" in format_table(summary)


def _record(variant, seconds, reached=True, to_target=1.0):
    return {
        "variant": variant,
        "class": f"x.{variant}",
        "num_threads": 1,
        "learn_seconds": seconds,
        "steps_per_second": 100 / seconds,
        "final_return_mean": 500.0,
        "peak_memory_mb": 300.0,
        "reached_target": reached,
        "time_to_target": to_target if reached else None,
        "target_return": 475.0,
    }


def test_summary_ratio_of_medians_and_failures_count_full_budget():
    records = [_record("ours", s) for s in (1.0, 2.0, 9.0)] + [_record("stock", s) for s in (6.0, 8.0, 10.0)]
    summary = summarize(records, ["ours", "stock"])
    assert summary["variants"]["ours"]["median_learn_seconds"] == 2.0
    assert summary["speedup"]["stock"] == pytest.approx(1.0)  # time-to-target mode: both medians 1.0
    records[3:] = [_record("stock", 6.0, reached=False), _record("stock", 8.0, reached=False), _record("stock", 10.0)]
    summary = summarize(records, ["ours", "stock"])
    assert summary["variants"]["stock"]["success_rate"] == pytest.approx(1 / 3)
    assert summary["variants"]["stock"]["median_time_to_target"] == 6.0 and summary["speedup"]["stock"] == 6.0
    assert "| stock | stock | 1 | 6.00 | 6.00x |" in format_table(summary, target=True)


@pytest.mark.slow
def test_bench_command_writes_json_and_png(tmp_path, capsys):
    argv = ["bench", "--algo", "ppo", "--env", "CartPole-v1", "-n", "512", "--seeds", "0", "--eval-episodes", "2"]
    argv += ["--curve-points", "2", "--out-dir", str(tmp_path), "--variants", "ours", "stock-1t"]
    code = main([*argv, "-params", "n_envs:2", "n_steps:64", "batch_size:64"])
    assert code == 0
    result = json.loads((tmp_path / "ppo_CartPole-v1.json").read_text())
    assert [r["variant"] for r in result["records"]] == ["ours", "stock-1t"]
    assert [r["num_threads"] for r in result["records"]] == [1, 1]
    assert all(r["timesteps"] == 512 and len(r["curve"]) == 2 and r["peak_memory_mb"] > 0 for r in result["records"])
    assert (tmp_path / "ppo_CartPole-v1.png").stat().st_size > 1000
    assert "| ours |" in capsys.readouterr().out


def test_stock_1t_keeps_sb3_adam_settings():
    import torch as th
    from stable_baselines3 import PPO as StockPPO

    from sb3_speedups.bench.worker import use_fused_adam

    model = StockPPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16)
    use_fused_adam(model)
    optimizer = model.policy.optimizer
    assert type(optimizer) is th.optim.Adam and optimizer.defaults["fused"] and optimizer.defaults["eps"] == 1e-5
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.policy.parameters()
    )
    model.learn(32)


def test_stock_1t_fuses_an_off_policy_actor_and_critic():
    import torch as th
    from sb3_contrib import TQC as StockTQC

    from sb3_speedups.bench.worker import use_fused_adam

    model = StockTQC("MlpPolicy", "Pendulum-v1", learning_starts=8, batch_size=8, policy_kwargs=dict(net_arch=[8]))
    use_fused_adam(model)  # TQC's policy has no optimizer of its own: its actor and critic have one each
    for part in (model.policy.actor, model.policy.critic):
        assert type(part.optimizer) is th.optim.Adam and part.optimizer.defaults["fused"]
    model.learn(16)


def test_peak_memory_counts_live_descendants_not_ended_ones():
    base = tree_pss_mb()
    code = "import sys, time; b = b'x' * (100 * 2**20); print('ready', flush=True); time.sleep(60)"
    with PeakMemory(interval_s=0.05) as memory:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            assert tree_pss_mb() >= base + 90
            time.sleep(0.3)  # a few sampling intervals
        finally:
            child.kill()
            child.wait()
    assert memory.peak_mb >= base + 90  # the child was sampled while it lived
    assert tree_pss_mb() < base + 50  # an ended child no longer counts
