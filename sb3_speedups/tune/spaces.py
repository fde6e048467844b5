"""
The built-in search spaces (the registry's ``sampler=`` entries), written in the format of
:mod:`sb3_speedups.tune.search_space`. They only offer an option (``recompute_advantages``, ``double_q``, dueling
heads, GRU cells, ...) when the algorithm class (or its policy) accepts it, so they pick up our faster classes as
they land, and still work with the stock ones.
"""

from __future__ import annotations

from typing import Any

from sb3_speedups.registry import import_object
from sb3_speedups.tune.search_space import Param, SearchSpace, policy_class
from sb3_speedups.zoo.validation import accepted_kwargs

PRIORITIZED_REPLAY = "sb3_speedups.dqn.replay.buffers.PrioritizedReplayBuffer"


def _params(*params: Param) -> dict[str, Param]:
    return {param.name: param for param in params}


def _policy_accepts(algo_cls: type, hyperparams: dict[str, Any], keyword: str) -> bool:
    cls = policy_class(algo_cls, hyperparams.get("policy", "MlpPolicy"))
    return cls is not None and keyword in accepted_kwargs(cls)


def _limit_minibatch(hp: dict[str, Any]) -> None:
    """A PPO minibatch cannot be larger than the rollout (``n_steps * n_envs``)."""
    n_steps, batch_size = hp.get("n_steps"), hp.get("batch_size")
    if isinstance(n_steps, int) and isinstance(batch_size, int):
        hp["batch_size"] = min(batch_size, n_steps * int(hp.get("n_envs", 1)))


def _limit_gradient_steps(hp: dict[str, Any]) -> None:
    """More gradient steps than collected steps per update only overfits the replay buffer."""
    train_freq, gradient_steps = hp.get("train_freq"), hp.get("gradient_steps")
    if isinstance(train_freq, int) and isinstance(gradient_steps, int) and gradient_steps > 0:
        hp["gradient_steps"] = min(gradient_steps, train_freq)


def _critic_rnn_with_shared(hp: dict[str, Any]) -> None:
    """sb3-contrib rejects a separate critic RNN when the actor's is shared."""
    kwargs = hp.get("policy_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("shared_lstm"):
        kwargs["enable_critic_lstm"] = False


def gae_params(algo_cls: type) -> dict[str, Param]:
    """
    The GAE-focused part of the PPO spaces: discount, GAE lambda, advantage normalisation and, where the class has
    it, recomputing advantages before each epoch.

    :param algo_cls: the PPO class
    :return: its parameters
    """
    params = _params(
        Param("one_minus_gamma", low=1e-4, high=0.1, log=True),
        Param("one_minus_gae_lambda", low=1e-3, high=0.2, log=True),
        Param("normalize_advantage", choices=(True, False)),
    )
    if "recompute_advantages" in accepted_kwargs(algo_cls):
        params.update(_params(Param("recompute_advantages", choices=(False, True))))
    return params


def ppo_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the PPO class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in PPO space
    """
    params = _params(
        Param("n_steps", choices=(16, 32, 64, 128, 256, 512, 1024)),
        Param("batch_size", choices=(32, 64, 128, 256, 512)),
        Param("n_epochs", choices=(1, 4, 10, 20)),
        Param("learning_rate", low=1e-5, high=3e-3, log=True),
        Param("learning_rate_schedule", choices=("constant", "linear")),
        Param("ent_coef", low=1e-8, high=0.05, log=True),
        Param("clip_range", choices=(0.1, 0.2, 0.3)),
        Param("vf_coef", low=0.2, high=1.0),
        Param("max_grad_norm", choices=(0.3, 0.5, 1.0, 5.0)),
        Param("policy_kwargs.net_arch", choices=("64x64", "128x128", "256x256")),
        Param("policy_kwargs.activation_fn", choices=("Tanh", "ReLU")),
    )
    params.update(gae_params(algo_cls))
    return SearchSpace(params, constraints=[_limit_minibatch])


def a2c_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the A2C class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in A2C space (the tuner keeps the ``n_steps`` whose rollout fits between two evaluations)
    """
    params = _params(
        Param("n_steps", choices=(5, 8, 16, 32, 64, 128, 256)),
        Param("learning_rate", low=1e-5, high=3e-3, log=True),
        Param("learning_rate_schedule", choices=("constant", "linear")),
        Param("ent_coef", low=1e-8, high=0.05, log=True),
        Param("vf_coef", low=0.2, high=1.0),
        Param("max_grad_norm", choices=(0.3, 0.5, 1.0, 5.0)),
        Param("use_rms_prop", choices=(True, False)),
        Param("policy_kwargs.net_arch", choices=("64x64", "128x128", "256x256")),
        Param("policy_kwargs.activation_fn", choices=("Tanh", "ReLU")),
    )
    params.update(gae_params(algo_cls))
    return SearchSpace(params)


def trpo_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the TRPO class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in TRPO space (the RL Zoo's TRPO ranges: the critic's minibatches and epochs, CG, trust region)
    """
    params = _params(
        Param("n_steps", choices=(128, 256, 512, 1024, 2048)),
        Param("batch_size", choices=(32, 64, 128, 256, 512)),
        Param("learning_rate", low=1e-5, high=3e-3, log=True),
        Param("n_critic_updates", choices=(5, 10, 20, 25, 30)),
        Param("cg_max_steps", choices=(5, 10, 20, 25, 30)),
        Param("target_kl", choices=(0.1, 0.05, 0.03, 0.02, 0.01, 0.005, 0.001)),
        Param("policy_kwargs.net_arch", choices=("64x64", "128x128", "256x256")),
        Param("policy_kwargs.activation_fn", choices=("Tanh", "ReLU")),
    )
    params.update(gae_params(algo_cls))
    return SearchSpace(params, constraints=[_limit_minibatch])


def dqn_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the DQN class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in DQN space, with the replay options the class offers
    """
    params = _params(
        Param("learning_rate", low=1e-5, high=1e-2, log=True),
        Param("batch_size", choices=(32, 64, 128, 256)),
        Param("buffer_size", choices=(10_000, 50_000, 100_000, 1_000_000)),
        Param("learning_starts", choices=(0, 1000, 5000)),
        Param("one_minus_gamma", low=1e-3, high=0.1, log=True),
        Param("target_update_interval", choices=(1, 10, 100, 1000, 5000)),
        Param("train_freq", choices=(1, 4, 16, 64, 256)),
        Param("gradient_steps", choices=(1, 4, 16, 64, 128)),
        Param("exploration_fraction", low=0.0, high=0.5),
        Param("exploration_final_eps", low=0.0, high=0.2),
        Param("policy_kwargs.net_arch", choices=("64", "64x64", "256x256")),
        Param("n_steps", choices=(1, 3, 5)),
    )
    accepted = accepted_kwargs(algo_cls)
    for option in ("double_q", "combined_replay"):
        if option in accepted:
            params.update(_params(Param(option, choices=(False, True))))
    if "dueling" in getattr(algo_cls, "extra_policy_kwargs", ()) or _policy_accepts(algo_cls, hyperparams, "dueling"):
        params.update(_params(Param("policy_kwargs.dueling", choices=(False, True))))
    if _ours(algo_cls) and _importable(PRIORITIZED_REPLAY):
        params.update(_params(Param("replay_buffer_class", choices=(None, PRIORITIZED_REPLAY))))
    return SearchSpace(params, constraints=[_limit_gradient_steps, _combined_replay_one_step])


def qrdqn_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the QR-DQN class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the DQN space (without prioritised replay: QR-DQN's loss has no TD error per sample) and the quantile count
    """
    space = dqn_space(algo_cls, hyperparams)
    params = {name: param for name, param in space.params.items() if name != "replay_buffer_class"}
    params.update(_params(Param("policy_kwargs.n_quantiles", choices=(10, 25, 50, 100, 200))))
    return SearchSpace(params, constraints=space.constraints)


def _continuous_control_params() -> dict[str, Param]:
    """What the SAC and TD3 spaces share (the RL Zoo's off-policy samplers: discount, batch, learning rate, polyak
    coefficient, update frequency, network size)."""
    return _params(
        Param("one_minus_gamma", low=1e-4, high=0.03, log=True),
        Param("batch_size", choices=(32, 64, 128, 256, 512, 1024, 2048)),
        Param("learning_rate", low=1e-5, high=2e-3, log=True),
        Param("train_freq", low=1, high=10, integer=True),
        Param("tau", low=1e-3, high=0.08, log=True),
        Param("policy_kwargs.net_arch", choices=("64x64", "256x256", "400x300")),
    )


def _one_update_per_step(hp: dict[str, Any]) -> None:
    """As the RL Zoo's samplers: one gradient step per collected step (``gradient_steps = train_freq``)."""
    if isinstance(hp.get("train_freq"), int):
        hp["gradient_steps"] = hp["train_freq"]


def sac_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the SAC class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in SAC space
    """
    return SearchSpace(_continuous_control_params(), constraints=[_one_update_per_step])


def td3_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the TD3 (or DDPG) class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in TD3 space: SAC's plus the exploration noise
    """
    params = _continuous_control_params()
    params.update(
        _params(
            Param("noise_type", choices=("normal", "ornstein-uhlenbeck", None)),
            Param("noise_std", low=0.0, high=0.5),
        )
    )
    return SearchSpace(params, constraints=[_one_update_per_step])


def tqc_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the TQC class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the SAC space plus the RL Zoo's TQC options: quantiles per critic and the top ones dropped per critic
    """
    space = sac_space(algo_cls, hyperparams)
    params = dict(space.params)
    params.update(
        _params(
            Param("policy_kwargs.n_quantiles", low=5, high=50, integer=True),
            Param("top_quantiles_to_drop_per_net", low=0, high=5, integer=True),
        )
    )
    return SearchSpace(params, constraints=[*space.constraints, _keep_a_quantile])


def crossq_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the CrossQ class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the SAC space without the polyak coefficient (CrossQ has no target networks) plus its delayed policy
        updates
    """
    params = {name: param for name, param in _continuous_control_params().items() if name != "tau"}
    params.update(_params(Param("policy_delay", choices=(1, 2, 3, 5))))
    return SearchSpace(params, constraints=[_one_update_per_step])


def ars_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the ARS class that will be trained
    :param hyperparams: the YAML section
    :return: the RL Zoo's ARS space: perturbations per update, the top ones kept, step size and noise scale
    """
    params = _params(
        Param("n_delta", choices=(4, 8, 16, 32, 64)),
        Param("n_top", choices=(1, 2, 4, 8, 16, 32, 64)),
        Param("learning_rate", low=1e-5, high=1.0, log=True),
        Param("delta_std", choices=(0.01, 0.02, 0.025, 0.03, 0.05, 0.1, 0.2, 0.3)),
    )
    return SearchSpace(params, constraints=[_top_within_deltas])


def _top_within_deltas(hp: dict[str, Any]) -> None:
    """ARS keeps at most ``n_delta`` perturbations (stock would warn and clip)."""
    n_delta, n_top = hp.get("n_delta"), hp.get("n_top")
    if isinstance(n_delta, int) and isinstance(n_top, int):
        hp["n_top"] = min(n_top, n_delta)


def _keep_a_quantile(hp: dict[str, Any]) -> None:
    """As the RL Zoo's sampler: TQC drops fewer quantiles per critic than each has."""
    kwargs, dropped = hp.get("policy_kwargs"), hp.get("top_quantiles_to_drop_per_net")
    n_quantiles = kwargs.get("n_quantiles") if isinstance(kwargs, dict) else None
    if isinstance(n_quantiles, int) and isinstance(dropped, int):
        hp["top_quantiles_to_drop_per_net"] = min(dropped, n_quantiles - 1)


def _combined_replay_one_step(hp: dict[str, Any]) -> None:
    """Combined replay needs a one-step buffer (SB3's n-step buffer cannot be gathered at given indices)."""
    if hp.get("combined_replay") and int(hp.get("n_steps", 1)) > 1 and hp.get("replay_buffer_class") is None:
        hp["combined_replay"] = False


def _ours(algo_cls: type) -> bool:
    """Stock SB3 DQN would sample a prioritised buffer but never update its priorities."""
    return algo_cls.__module__.startswith("sb3_speedups.")


def _importable(dotted: str) -> bool:
    module, _, attr = dotted.rpartition(".")
    try:
        import_object(f"{module}:{attr}")
    except (ImportError, AttributeError):
        return False
    return True


def ppo_lstm_space(algo_cls: type, hyperparams: dict[str, Any]) -> SearchSpace:
    """
    :param algo_cls: the RecurrentPPO class that will be trained
    :param hyperparams: the YAML section (for the policy)
    :return: the built-in recurrent PPO space (LSTM or GRU where the policy offers it, hidden size)
    """
    params = _params(
        Param("n_steps", choices=(16, 32, 64, 128, 256)),
        Param("batch_size", choices=(32, 64, 128, 256)),
        Param("n_epochs", choices=(1, 4, 10, 20)),
        Param("learning_rate", low=1e-5, high=3e-3, log=True),
        Param("ent_coef", low=1e-8, high=0.05, log=True),
        Param("clip_range", choices=(0.1, 0.2, 0.3)),
        Param("policy_kwargs.lstm_hidden_size", choices=(16, 32, 64, 128, 256)),
        Param("policy_kwargs.enable_critic_lstm", choices=(True, False)),
    )
    params.update(gae_params(algo_cls))
    if _policy_accepts(algo_cls, hyperparams, "rnn_type"):
        params.update(_params(Param("policy_kwargs.rnn_type", choices=("lstm", "gru"))))
    return SearchSpace(params, constraints=[_limit_minibatch, _critic_rnn_with_shared])
