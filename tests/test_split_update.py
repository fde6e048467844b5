"""The PPO update split over the training process and a forked helper process (sb3_speedups.ppo.split_update)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import stable_baselines3
import torch as th
from stable_baselines3.common.env_util import make_vec_env

from sb3_speedups import PPO
from sb3_speedups.ppo import split_update
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.ppo.minibatches import MinibatchSampler
from sb3_speedups.ppo.update import STATS, VALUE_LOSS, HandDerivedPPOUpdate, PPOLossConfig
from sb3_speedups.ppo.split_update import HelperError, SplitPPOUpdate, deferred_sigint
from sb3_speedups.errors import UserError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="split updates need Linux's fork()")

SMALL = dict(n_steps=16, batch_size=32, n_epochs=3, learning_rate=1e-3, seed=0, verbose=0)


def _model(**kwargs: object) -> PPO:
    return PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=4, seed=0), **{**SMALL, **kwargs})


def _params(model: PPO) -> th.Tensor:
    return th.cat([p.detach().flatten() for p in model.policy.parameters()]).clone()


def _running(pid: int) -> bool:
    """:return: whether ``pid`` is a live process (not gone, not a zombie)"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _updaters(clip_range_vf: float | None) -> tuple[HandDerivedPPOUpdate, SplitPPOUpdate, MinibatchSampler]:
    """One-process and split updates of two equal policies, and a sampler holding a random rollout."""
    model = _model(clip_range_vf=clip_range_vf)
    stock = stable_baselines3.PPO("MlpPolicy", model.env, **SMALL)
    stock.policy.load_state_dict(model.policy.state_dict())
    head = make_head(model.policy.action_dist, model.action_space)
    assert head is not None
    one = HandDerivedPPOUpdate(stock.policy, head, split=True)  # the same unstacked networks and layout, in one process
    two = SplitPPOUpdate(model.policy, head)
    gen = th.Generator().manual_seed(1)
    n = 64
    sampler = MinibatchSampler(16, 4, 32, th.device("cpu"))
    actions = th.randint(0, 2, (n,), generator=gen).float()
    scalars = th.randn(4, n, generator=gen)
    scalars[1] = -th.rand(n, generator=gen) - 0.2  # old log-probabilities
    sampler.load(th.randn(n, 4, generator=gen), one.training_actions(actions), scalars)
    return one, two, sampler


@pytest.mark.parametrize("clip_range_vf", [None, 0.1])
def test_split_update_gives_exactly_the_one_process_numbers(clip_range_vf: float | None) -> None:
    one, two, sampler = _updaters(clip_range_vf)
    cfg = PPOLossConfig(0.2, clip_range_vf, 0.01, 0.5, 0.05)  # a small max norm: the clipping couples the parts
    rows = 3 * sampler.n_minibatches()
    for _ in range(3):  # three train() calls of three epochs
        stats_one, stats_two = th.zeros(rows, len(STATS)), th.zeros(rows, len(STATS))
        np.random.seed(0)
        row = 0
        for _ in range(3):
            sampler.shuffle()
            for mb in sampler.minibatches():
                one.forward(mb, cfg, stats_one[row])
                one.backward()
                one.optimizer_step(cfg.max_grad_norm)
                row += 1
        np.random.seed(0)
        two.begin_train(sampler, cfg, rows)
        row = 0
        for _ in range(3):
            if sampler.draw():
                sampler.gather()
                two.gathered(sampler.index)
            for mb in sampler.minibatches():
                two.begin_minibatch(mb, row)
                two.forward(mb, cfg, stats_two[row])
                two.backward()
                two.optimizer_step(cfg.max_grad_norm)
                row += 1
        two.end_train(stats_two, rows)
        assert th.equal(one.flat.data, two.flat.data)
        assert th.equal(one.adam.exp_avg, two.adam.exp_avg) and th.equal(one.adam.exp_avg_sq, two.adam.exp_avg_sq)
        keep = [i for i in range(len(STATS)) if i != VALUE_LOSS]
        assert th.equal(stats_one[:, keep], stats_two[:, keep])
        th.testing.assert_close(stats_one[:, VALUE_LOSS], stats_two[:, VALUE_LOSS])
    assert float(two.adam.steps[0]) == float(one.adam.steps[0]) == 18
    two.close()


def test_auto_runs_split_on_two_cpus_and_learns_cartpole() -> None:
    if split_update.available_cpus() < 2:
        pytest.skip("needs 2 CPUs")
    model = PPO(
        "MlpPolicy", make_vec_env("CartPole-v1", n_envs=8, seed=0), n_steps=32, batch_size=256, n_epochs=20,
        learning_rate=1e-3, gae_lambda=0.8, gamma=0.98, ent_coef=0.0, seed=0, verbose=0,
    )  # fmt: skip
    model.learn(20_000)
    assert model._speedups is not None and isinstance(model._speedups.updater, SplitPPOUpdate)
    pid = model._speedups.updater.helper_pid()
    assert pid is not None and _running(pid)
    values = model.logger.name_to_value
    assert np.isfinite(values["train/value_loss"]) and values["train/value_loss"] > 0
    returns = [ep["r"] for ep in model.ep_info_buffer]
    assert np.mean(returns) > 60, returns  # random play: ~22
    # the helper ends with its model
    del model
    gc.collect()
    deadline = time.time() + 5
    while _running(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def test_split_update_follows_its_argument_and_the_process_rules(torch_threads_restored: None) -> None:
    with pytest.raises(UserError, match="split_update='yes' is invalid"):
        _model(split_update="yes")
    assert _model(split_update=False).split_update_unsupported_reason() == "split_update=False"
    assert "recompute_advantages" in str(_model(recompute_advantages=True).split_update_unsupported_reason())
    assert _model(split_update=True).split_update_unsupported_reason() is None
    model = _model()
    th.set_num_threads(2)
    if split_update.available_cpus() >= 2:
        assert "several threads" in str(model.split_update_unsupported_reason())


def test_a_killed_helper_raises_one_clear_error_instead_of_hanging() -> None:
    _, two, sampler = _updaters(None)
    cfg = PPOLossConfig(0.2, None, 0.0, 0.5, 0.5)
    two.begin_train(sampler, cfg, 2)
    pid = two.helper_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    sampler.shuffle()
    mb = next(iter(sampler.minibatches()))
    two.begin_minibatch(mb, 0)
    two.forward(mb, cfg, th.zeros(len(STATS)))
    two.backward()
    with pytest.raises(HelperError, match="was killed by SIGKILL; train with split_update=False"):
        two.optimizer_step(cfg.max_grad_norm)
    assert not _running(pid)
    two.close()


def test_an_error_in_the_helper_is_raised_in_the_training_process() -> None:
    _, two, sampler = _updaters(None)
    two.begin_train(sampler, PPOLossConfig(0.2, None, 0.0, 0.5, 0.5), 2)
    helper = two._helper
    assert helper is not None
    with pytest.raises(
        HelperError, match=r"helper process failed: ValueError: unknown command 99 \(at .*split_update.py:\d+\)"
    ):
        helper.wait(helper.post(99))
    assert two._helper is helper and not helper.alive()
    two.close()


@pytest.fixture
def python_ctrl_c() -> Iterator[None]:
    """
    Python's own Ctrl-C handling for the test: a process started in the background by a non-interactive shell
    inherits SIGINT ignored, and Python then installs no ``KeyboardInterrupt`` handler.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_split_train_stops_at_a_minibatch_boundary(python_ctrl_c: None) -> None:
    model = _model(split_update=True)
    model.learn(64)  # one rollout, one train(): the helper runs
    updater = model._speedups.updater  # type: ignore[union-attr]
    assert isinstance(updater, SplitPPOUpdate)
    calls = []
    original = SplitPPOUpdate.optimizer_step

    def step_then_ctrl_c(self: SplitPPOUpdate, max_grad_norm: float) -> None:
        original(self, max_grad_norm)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    SplitPPOUpdate.optimizer_step = step_then_ctrl_c  # type: ignore[method-assign]
    try:
        before = model._n_updates
        with pytest.raises(KeyboardInterrupt):
            model.learn(64, reset_num_timesteps=False)
    finally:
        SplitPPOUpdate.optimizer_step = original  # type: ignore[method-assign]
    assert len(calls) == 2 and model._n_updates == before + 1  # stopped after the 2nd of 6 minibatches
    assert float(updater.adam.steps[0]) == 2 * 3 + 2
    assert updater.helper_pid() is None  # stopped; the next train() starts a fresh one
    model.learn(64, reset_num_timesteps=False)
    assert updater.helper_pid() is not None


def test_deferred_sigint_raises_after_the_block(python_ctrl_c: None) -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint() as interrupted:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            reached.append(bool(interrupted))
    assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_helper_dies_with_its_training_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "from stable_baselines3.common.env_util import make_vec_env\n"
        "from sb3_speedups import PPO\n"
        "m = PPO('MlpPolicy', make_vec_env('CartPole-v1', n_envs=4), n_steps=16, batch_size=32, n_epochs=2, "
        "split_update=True)\n"
        "m.learn(64)\n"
        "print(m._speedups.updater.helper_pid(), flush=True)\n"
        "os._exit(0)\n"  # no clean-up at all, as a crash
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.time() + 5
    while _running(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


@pytest.mark.parametrize("trainers", [1, 2])
def test_tune_trainings_use_split_updates_only_with_two_cpus_each(trainers: int, monkeypatch) -> None:
    from sb3_speedups.tune import training

    before = _model().split_update_unsupported_reason()
    models, create_model = [], training.create_model
    monkeypatch.setattr(training, "create_model", lambda *args: models.append(create_model(*args)) or models[-1])
    job = training.TrialJob(
        "ppo", "CartPole-v1", {"n_envs": 2, "n_steps": 16, "batch_size": 32, "n_epochs": 1}, 64, [64], n_eval_episodes=1,
        device="cpu", concurrent_trainers=trainers,
    )  # fmt: skip
    result = training.train_seed(job, 0, lambda index, value: True)
    assert len(result.returns) == 1
    assert models[0].split_update == ("auto" if 2 * trainers <= split_update.available_cpus() else False)
    assert _model().split_update_unsupported_reason() == before  # nothing process-wide: later trainings decide alone


def test_target_kl_stops_the_split_epochs_as_it_stops_the_one_process_ones() -> None:
    counts = []
    for split in (False, True):
        model = _model(split_update=split, target_kl=1e-9, n_epochs=5)
        model.learn(128)  # two rollouts: the first minibatch of each train() exceeds the target once it has moved
        counts.append((type(model._speedups.updater).__name__, model._n_updates))  # type: ignore[union-attr]
        model._close_speedups()
    assert counts[0][0] == "HandDerivedPPOUpdate" and counts[1][0] == "SplitPPOUpdate"
    assert counts[0][1] == counts[1][1] < 2 * 5


def test_a_sigterm_during_the_fork_is_not_lost(tmp_path: Path) -> None:
    # The signal arrives while the after-fork hooks run; unblocked there, its handler's KeyboardInterrupt would be
    # swallowed ("Exception ignored in ...") and training would go on (as a tune run once did).
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, sys\n"
        "from stable_baselines3.common.env_util import make_vec_env\n"
        "from sb3_speedups import PPO\n"
        "def handler(signum, frame):\n"
        "    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, handler)\n"
        "sent = []\n"
        "def kill_once():\n"
        "    if not sent:\n"
        "        sent.append(1)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.register_at_fork(after_in_parent=kill_once)\n"
        "m = PPO('MlpPolicy', make_vec_env('CartPole-v1', n_envs=4), n_steps=16, batch_size=32, n_epochs=2, "
        "split_update=True)\n"
        "try:\n"
        "    m.learn(640)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', m.num_timesteps, m._speedups.updater.helper_pid(), flush=True)\n"
        "    sys.exit(130)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr
    assert out.stdout.split() == ["interrupted", "64", "None"]  # in the first train(); the helper stopped
