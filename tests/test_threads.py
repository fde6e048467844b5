"""
Torch's settings follow the work: convolutions get every core (as stock runs), small MLPs one, a user's choice wins;
convolutions train on channels-last inputs; training convolutions keeps freed large blocks in the process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecFrameStack

from sb3_speedups import A2C, DQN, PPO, SAC, RecurrentPPO
from sb3_speedups.common import torch_utils
from tests.space_envs import BoxObsEnv

DISCRETE, BOX = spaces.Discrete(3), spaces.Box(-1, 1, (2,))
CASES = [
    (PPO, "CnnPolicy", DISCRETE, {}),
    (A2C, "CnnPolicy", DISCRETE, {}),
    (DQN, "CnnPolicy", DISCRETE, {"buffer_size": 100}),
    (SAC, "CnnPolicy", BOX, {"buffer_size": 100}),
    (RecurrentPPO, "CnnLstmPolicy", DISCRETE, {}),
]


@pytest.fixture
def startup_threads(torch_threads_restored):
    """Torch's own default here (every core); skips on a one-core machine."""
    if torch_utils._STARTUP_NUM_THREADS < 2:
        pytest.skip("torch's default is one thread here")
    return torch_utils._STARTUP_NUM_THREADS


@pytest.mark.parametrize("cls, policy, action_space, kwargs", CASES, ids=[c[0].__name__ for c in CASES])
def test_convolutions_get_torch_default_threads_and_mlps_one(cls, policy, action_space, kwargs, startup_threads):
    def env(image: bool):
        return make_vec_env(lambda: BoxObsEnv(action_space, image=image), n_envs=1, seed=0)

    cls(policy.replace("Cnn", "Mlp"), env(False), seed=0, **kwargs)
    assert th.get_num_threads() == 1
    cls(policy, env(True), seed=0, **kwargs)
    assert th.get_num_threads() == startup_threads
    cls(policy.replace("Cnn", "Mlp"), env(False), seed=0, **kwargs)
    assert th.get_num_threads() == 1
    cls(policy, env(True), seed=0, num_threads=1, **kwargs)  # the user's choice wins
    assert th.get_num_threads() == 1


TRAINED_CNNS = [
    (PPO, {"n_steps": 16, "batch_size": 16}),
    (A2C, {"n_steps": 8}),
    (DQN, {"learning_starts": 8, "buffer_size": 64}),
]


@pytest.mark.parametrize("cls, kwargs", TRAINED_CNNS, ids=[c[0].__name__ for c in TRAINED_CNNS])
def test_convolutions_train_on_channels_last_inputs(cls, kwargs, torch_threads_restored):
    # 4 stacked channels: a one-channel image is contiguous in both memory orders
    env = VecFrameStack(make_vec_env(lambda: BoxObsEnv(DISCRETE, image=True), n_envs=1, seed=0), 4)
    model = cls("CnnPolicy", env, seed=0, **kwargs)
    first_conv = next(m for m in model.policy.modules() if isinstance(m, th.nn.Conv2d))
    seen: dict[bool, set[bool]] = {True: set(), False: set()}  # grad enabled (training) -> channels-last inputs seen

    def record(module, inputs):
        seen[th.is_grad_enabled()].add(inputs[0].is_contiguous(memory_format=th.channels_last))

    first_conv.register_forward_pre_hook(record)
    model.learn(32)
    if cls is A2C:  # its update runs no convolution forward: the backward takes acting's kept outputs, channels-last
        actor = model._speedups.actor
        assert seen[True] == set() and actor.rows == -1
        assert all(t.is_contiguous(memory_format=th.channels_last) for t in actor.outputs)
        return
    assert seen[True] == {True}  # acting's inputs come as they are (VecTransposeImage's views are channels-last already)


# Builds a model in a fresh process (the allocator setting is process-wide and stays), then allocates and frees two
# 40 MB blocks, four times to settle the heap and five times counting page faults: glibc maps blocks of 32 MB and more
# afresh each time by default (a fault per 4 KB page, ~100k in all), and reuses them once the setting is in effect
# (none, or one block's worth in a round while the heap settles: seen after two rounds, not after four).
_FAULTS_AFTER_MODEL = textwrap.dedent(
    """
    import resource, sys
    import torch as th
    from stable_baselines3.common.env_util import make_vec_env
    from gymnasium import spaces
    from sb3_speedups import PPO
    from sb3_speedups.common import torch_utils
    from tests.space_envs import BoxObsEnv

    image = sys.argv[1] == "Cnn"
    env = make_vec_env(lambda: BoxObsEnv(spaces.Discrete(3), image=image), n_envs=1, seed=0)
    PPO(sys.argv[1] + "Policy", env, n_steps=16, batch_size=16, seed=0)
    for rounds in (4, 5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            a, b = th.ones(10 * 2**20), th.ones(10 * 2**20)
            del a, b
    print(torch_utils._freed_blocks_kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults_after_model(policy: str, **env_vars: str) -> tuple[bool, int]:
    """:return: whether the setting is in effect after building a PPO ``policy`` model, and the page faults counted"""
    env = {k: v for k, v in os.environ.items() if k not in (*torch_utils._MALLOC_ENV_VARS, "GLIBC_TUNABLES")} | env_vars
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_AFTER_MODEL, policy], env=env, capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    return out[-2] == "True", int(out[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_convolutions_keep_freed_blocks_mlps_and_a_users_malloc_settings_do_not():
    pages = 2 * 10 * 2**20 * 4 // 4096  # of one round's two blocks
    kept, faults = _faults_after_model("Cnn")
    assert kept and faults < 2 * pages  # none, with a margin of two rounds' worth
    kept, faults = _faults_after_model("Mlp")
    assert not kept and faults > 4 * pages  # glibc's default: each round's blocks are faulted in afresh
    assert _faults_after_model("Cnn", GLIBC_TUNABLES="glibc.cpu.x86_shstk=off")[0]  # not a malloc parameter
    for env_var in ({"MALLOC_TOP_PAD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}):
        assert not _faults_after_model("Cnn", **env_var)[0]  # the user set glibc's malloc parameters: theirs win
