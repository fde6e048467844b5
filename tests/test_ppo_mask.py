"""MaskablePPO: masked sampling, the masked head's gradient, first rollouts, predict, evaluation and the CLI."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import sb3_contrib
import torch as th
from gymnasium.wrappers import FlattenObservation
from sb3_contrib.common.envs import InvalidActionEnvMultiBinary
from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback
from sb3_contrib.common.maskable.distributions import make_masked_proba_distribution
from sb3_contrib.common.wrappers import ActionMasker
from stable_baselines3.common.env_util import make_vec_env

from sb3_speedups import MaskablePPO
from sb3_speedups.cli import main
from sb3_speedups.common.nn.heads.categorical import CategoricalHead
from sb3_speedups.common.nn.heads.masked import MASKED_LOGIT, MaskedCategoricalHead, make_masked_head
from sb3_speedups.ppo_mask import FastMaskableRolloutBuffer
from sb3_speedups.registry import get_algo, import_object
from tests.algo_cases import as_stock_layout

SMALL = dict(n_steps=16, batch_size=32, n_epochs=2, seed=3, ent_coef=0.01)


def multibinary_env() -> gym.Env:
    return FlattenObservation(InvalidActionEnvMultiBinary(dims=4, ep_length=5, n_invalid_actions=2))


ENVS = {
    "discrete": lambda: gym.make("InvalidActionEnvDiscrete-v0", ep_length=5),
    "multidiscrete": lambda: gym.make("InvalidActionEnvMultiDiscrete-v0", ep_length=5),
    "multibinary": multibinary_env,
    "knapsack": lambda: gym.make("MaskedKnapsack-v0"),
}


def vec_env(name: str, n_envs: int = 4):
    return make_vec_env(ENVS[name], n_envs=n_envs, seed=3)


def random_masks(rng: np.random.Generator, n: int, nvec: list[int]) -> np.ndarray:
    """:return: ``[n, sum(nvec)]`` masks with at least one allowed choice per block"""
    blocks = []
    for k in nvec:
        block = rng.random((n, k)) < 0.4
        block[np.arange(n), rng.integers(0, k, n)] = True
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


@pytest.mark.parametrize("name", ["discrete", "multidiscrete", "multibinary"])
@pytest.mark.parametrize("rows", [4, 256])  # the numpy executor (a few rows) and torch's
def test_masked_sampling_never_picks_a_masked_action(name: str, rows: int) -> None:
    model = MaskablePPO("MlpPolicy", vec_env(name), **SMALL)
    speed = model._ensure_speedups()
    assert speed is not None
    head = speed.actor.head
    nvec, starts = head.nvec, np.cumsum([0, *head.nvec[:-1]])
    rng = np.random.default_rng(0)
    obs_dim = model.observation_space.shape[0]
    picked = np.zeros(sum(nvec), dtype=bool)
    for _ in range(400 if rows == 4 else 20):
        obs = rng.random((rows, obs_dim)).astype(np.float32) * 4
        masks = random_masks(rng, rows, nvec)
        actions, _, log_prob = speed.actor.act(obs, masks)
        index = np.asarray(actions).reshape(rows, len(nvec)) + starts
        assert masks[np.arange(rows)[:, None], index].all()
        assert th.isfinite(log_prob).all()
        picked[index.ravel()] = True
    assert picked.all()  # every choice is drawn somewhere: masking, not a stuck sampler


@pytest.mark.parametrize("name", list(ENVS))
def test_first_rollout_equals_sb3_contrib(name: str) -> None:
    buffers = []
    for cls in (sb3_contrib.MaskablePPO, MaskablePPO):
        model = cls("MlpPolicy", vec_env(name), **SMALL)
        _, callback = model._setup_learn(10_000, None)
        assert model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
        buffers.append(model.rollout_buffer)
    stock, ours = buffers
    assert isinstance(ours, FastMaskableRolloutBuffer)
    assert not stock.action_masks.all()  # masks were applied
    for field in ("observations", "actions", "episode_starts", "action_masks"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(stock, field), err_msg=field)
    # rewards: a truncated episode's carry gamma * V(terminal observation)
    for field in ("rewards", "values", "log_probs", "advantages", "returns"):
        np.testing.assert_allclose(getattr(ours, field), getattr(stock, field), rtol=0, atol=1e-5, err_msg=field)


@pytest.mark.parametrize("nvec", [[7], [3, 4, 2], [2, 2, 2]])
def test_masked_head_gradient_equals_autograd(nvec: list[int]) -> None:
    """docs/maths.md, "Masked categorical": the plain categorical's gradient on the masked logits equals autograd's."""
    n, rng = 64, np.random.default_rng(1)
    space = gym.spaces.Discrete(nvec[0]) if len(nvec) == 1 else gym.spaces.MultiDiscrete(nvec)
    dist = make_masked_proba_distribution(space)
    head = make_masked_head(dist)
    assert isinstance(head, MaskedCategoricalHead)
    out = th.randn(n, sum(nvec), dtype=th.float32) * 3
    masks = th.as_tensor(random_masks(rng, n, nvec))
    # actions drawn among the allowed choices, as collection draws them
    dist.proba_distribution(out)
    dist.apply_masking(masks)
    actions = dist.sample().float().view(n, -1)
    g_log_prob, entropy_grad = th.randn(n), -0.3

    leaf = out.clone().requires_grad_(True)
    dist.proba_distribution(leaf)
    dist.apply_masking(masks)
    log_prob = dist.log_prob(actions.long().view(-1) if len(nvec) == 1 else actions.long())
    entropy = dist.entropy()
    ((g_log_prob * log_prob).sum() + entropy_grad * entropy.sum()).backward()

    ws = head.workspace(n, th.device("cpu"))
    training = {**head.training_actions(actions), "masks": masks}
    ours_log_prob, neg_entropy, d_out = th.empty(n), th.empty(n), th.empty(n, sum(nvec))
    head.forward(ws, out, training, None, ours_log_prob, neg_entropy)
    head.backward(ws, g_log_prob, entropy_grad, d_out, None)
    th.testing.assert_close(ours_log_prob, log_prob.detach(), rtol=1e-5, atol=1e-5)
    th.testing.assert_close(-neg_entropy, entropy.detach(), rtol=1e-5, atol=1e-5)
    th.testing.assert_close(d_out, leaf.grad, rtol=1e-5, atol=1e-6)
    assert (d_out[~masks] == 0).all()


def test_predict_with_action_masks() -> None:
    model = MaskablePPO("MlpPolicy", vec_env("discrete"), **SMALL).learn(128)
    obs = model.env.reset()
    only = np.zeros((obs.shape[0], 10), dtype=bool)
    chosen = np.arange(obs.shape[0]) * 2 + 1
    only[np.arange(obs.shape[0]), chosen] = True
    for deterministic in (True, False):
        actions, _ = model.predict(obs, deterministic=deterministic, action_masks=only)
        np.testing.assert_array_equal(actions, chosen)


def test_action_masker_wrapper_and_use_masking_false() -> None:
    """Masks from the ActionMasker wrapper; ``use_masking=False`` trains unmasked (all-allowed masks stored)."""

    def make() -> gym.Env:
        env = gym.make("CartPole-v1")
        return ActionMasker(env, lambda e: np.array([True, False]))

    model = MaskablePPO("MlpPolicy", make_vec_env(make, n_envs=2, seed=0), **SMALL).learn(64)
    assert model._speedups is not None
    assert (model.rollout_buffer.actions == 0).all()
    model.learn(64, use_masking=False)
    assert model.rollout_buffer.action_masks.all() and (model.rollout_buffer.actions == 1).any()


def test_unsupported_models_run_sb3_contrib_code() -> None:
    model = MaskablePPO("MlpPolicy", vec_env("discrete"), fast_update=False, **SMALL).learn(128)
    stock = sb3_contrib.MaskablePPO("MlpPolicy", vec_env("discrete"), **SMALL).learn(128)
    assert model._speedups is None and model.fast_path_unsupported_reason() == "fast_update=False"
    for key, value in stock.policy.state_dict().items():
        th.testing.assert_close(model.policy.state_dict()[key], value, rtol=0, atol=0)


def test_maskable_eval_callback(tmp_path: Path) -> None:
    callback = MaskableEvalCallback(vec_env("discrete", n_envs=1), eval_freq=32, n_eval_episodes=3, log_path=str(tmp_path))
    MaskablePPO("MlpPolicy", vec_env("discrete"), **SMALL).learn(256, callback=callback)
    assert len(callback.evaluations_results) == 256 // (32 * 4)
    assert np.isfinite(callback.last_mean_reward) and (tmp_path / "evaluations.npz").is_file()


def test_cli_trains_ppo_mask(tmp_path: Path) -> None:
    argv = ["train", "--algo", "ppo_mask", "--env", "InvalidActionEnvDiscrete-v0", "--seed", "0"]
    assert main([*argv, "-n", "1024", "--log-folder", str(tmp_path), "--eval-freq", "512", "--quiet"]) == 0
    saved = next(tmp_path.glob("ppo_mask/InvalidActionEnvDiscrete-v0_1/InvalidActionEnvDiscrete-v0.zip"))
    loaded = sb3_contrib.MaskablePPO.load(saved)  # sb3-contrib loads the CLI's file
    assert loaded.num_timesteps >= 1024


def test_registry_and_search_space() -> None:
    spec = get_algo("ppo_mask")
    assert spec.cls() is MaskablePPO and spec.cls(stock=True) is sb3_contrib.MaskablePPO
    assert spec.sampler == "sb3_speedups.tune.spaces:ppo_space"
    space = import_object(spec.sampler)(MaskablePPO, {})
    assert "recompute_advantages" not in space.params  # PPO's own option, not MaskablePPO's


def test_knapsack_invalid_action_ends_the_episode_and_masks_shrink() -> None:
    env = gym.make("MaskedKnapsack-v0").unwrapped
    env.reset(seed=0)
    first = env.action_masks()
    item = int(np.flatnonzero(first)[0])
    _, reward, terminated, _, _ = env.step(item)
    assert reward > 0 and not terminated and not env.action_masks()[item]
    assert env.action_masks().sum() < first.sum()
    _, reward, terminated, _, info = env.step(item)  # taken already: invalid
    assert reward == 0.0 and terminated and info["invalid_action"]


def _dict_knapsack() -> gym.Env:
    env = gym.make("MaskedKnapsack-v0")
    return gym.wrappers.TransformObservation(env, lambda obs: {"x": obs}, gym.spaces.Dict({"x": env.observation_space}))


def test_dict_observations_of_vector_entries_run_fast_with_stocks_updates() -> None:
    models = [
        cls("MultiInputPolicy", make_vec_env(_dict_knapsack, n_envs=2, seed=0), **SMALL).learn(128)
        for cls in (MaskablePPO, sb3_contrib.MaskablePPO)
    ]
    ours, stock = models
    assert ours._speedups is not None and ours.fast_path_unsupported_reason() is None
    masks = ours.rollout_buffer.action_masks
    assert not masks.all() and ours.num_timesteps == 128
    stock_masks = stock.rollout_buffer.action_masks
    np.testing.assert_array_equal(as_stock_layout(masks, stock_masks), stock_masks)
    for key, value in stock.policy.state_dict().items():  # float32 rounding: the default tolerances, 1e-5
        th.testing.assert_close(ours.policy.state_dict()[key], value, msg=key)


def test_image_dict_observations_run_sb3_contrib_code() -> None:
    def make() -> gym.Env:
        env = _dict_knapsack()
        pixels = gym.spaces.Box(0, 255, (36, 36, 1), np.uint8)
        space = gym.spaces.Dict({"x": env.observation_space["x"], "pixels": pixels})
        return gym.wrappers.TransformObservation(env, lambda obs: {**obs, "pixels": pixels.sample()}, space)

    model = MaskablePPO("MultiInputPolicy", make_vec_env(make, n_envs=2, seed=0), **SMALL).learn(64)
    assert model._speedups is None and "entry 'pixels'" in str(model.fast_path_unsupported_reason())
    assert model.num_timesteps == 64


def test_masks_reader_equals_get_action_masks() -> None:
    """In-process envs (bare, under a VecEnv wrapper, through ActionMasker) use the cached lookups; others ask."""
    from sb3_contrib.common.maskable.utils import get_action_masks
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_speedups.ppo_mask.masks import _in_process_envs, masks_reader

    def masker() -> gym.Env:
        return ActionMasker(gym.make("CartPole-v1"), lambda e: np.array([e.unwrapped.state[0] > 0, True]))

    masked = make_vec_env(masker, n_envs=3, seed=0)
    for env in (vec_env("knapsack"), VecNormalize(vec_env("multidiscrete")), vec_env("discrete"), masked):
        # masks as arrays, as lists (sb3-contrib's envs), through wrappers
        assert _in_process_envs(env) is not None
        read = masks_reader(env)
        env.reset()
        env.action_space.seed(0)
        for _ in range(12):
            ours, expected = read(), get_action_masks(env)
            assert ours.dtype == expected.dtype and ours.shape == expected.shape
            np.testing.assert_array_equal(ours, expected)
            env.step(np.array([env.action_space.sample() for _ in range(env.num_envs)]))

    class Redirecting(VecNormalize):
        def env_method(self, method_name, *args, indices=None, **kwargs):  # type: ignore[no-untyped-def]
            return super().env_method(method_name, *args, indices=indices, **kwargs)

    assert _in_process_envs(Redirecting(vec_env("discrete"))) is None


@pytest.mark.parametrize("nvec", [[10], [5, 5, 5], [3, 4]])
def test_masked_head_forward_equals_the_plain_head_on_masked_logits(nvec: list[int]) -> None:
    """Bit for bit, with the underflowing exp skipped: rows with every choice masked, logits near exp's underflow."""
    generator = th.Generator().manual_seed(0)
    n, k = 64, sum(nvec)
    out = th.randn(n, k, generator=generator) * 5
    masks = th.rand(n, k, generator=generator) > 0.5
    masks[:, 0] = True
    masks[:3] = False
    out[5, 1], out[6, 2] = -105.0, -95.0
    head, plain = MaskedCategoricalHead(nvec), CategoricalHead(nvec)
    actions = head.training_actions(th.zeros(n, len(nvec)))
    results = []
    for h, logits in ((head, out), (plain, th.where(masks, out, th.tensor(MASKED_LOGIT)))):
        ws, log_prob, neg_entropy = h.workspace(n, th.device("cpu")), th.empty(n), th.empty(n)
        h.forward(ws, logits, {**actions, "masks": masks}, None, log_prob, neg_entropy)
        results.append((ws.p, ws.tmp, log_prob, neg_entropy))
    for ours, expected in zip(*results, strict=True):
        assert th.equal(ours, expected)
    assert (results[0][0] == 0).any() and (results[0][0][:3] > 0).all()
