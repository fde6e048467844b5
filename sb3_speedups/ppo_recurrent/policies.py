"""
Recurrent actor-critic policies (LSTM and GRU) whose training pass runs each padded sequence through ONE RNN call.

sb3-contrib's rollout buffer already cuts sequences at episode starts, so inside a training batch an episode can
only start at a sequence's first step: masking the initial state once is enough and the per-step Python loop of
``sb3_contrib``'s ``_process_sequence`` is not needed. GRU states keep sb3-contrib's ``(h, c)`` layout, ``c`` unused.
"""

from __future__ import annotations

from typing import Any

import torch as th
from gymnasium import spaces
from sb3_contrib.common.recurrent import policies as contrib
from stable_baselines3.common.distributions import CategoricalDistribution
from stable_baselines3.common.type_aliases import Schedule
from torch import nn
from torch.nn import functional as F

from sb3_contrib.common.recurrent.type_aliases import RNNStates

from sb3_speedups.ppo_recurrent.gru import gru_sequences

RNN_TYPES = ("lstm", "gru")


State = tuple[th.Tensor, ...]  # (h, c), as sb3-contrib keeps them


def process_sequence(
    features: th.Tensor, states: State, episode_starts: th.Tensor, rnn: nn.LSTM | nn.GRU
) -> tuple[th.Tensor, State]:
    """
    Run flattened padded sequences through an LSTM or GRU, resetting the state where an episode starts.

    :param features: ``(n_seq * seq_len, features_dim)``, sequence-major
    :param states: ``(h, c)``, each ``(n_layers, n_seq, hidden)``; ``c`` is passed through unchanged for a GRU
    :param episode_starts: ``(n_seq * seq_len,)``
    :param rnn: the recurrent module
    :return: ``(n_seq * seq_len, hidden)`` outputs and the final states
    """
    n_seq = states[0].shape[1]
    sequence = features.reshape((n_seq, -1, rnn.input_size)).swapaxes(0, 1)
    starts = episode_starts.reshape((n_seq, -1)).swapaxes(0, 1)
    if sequence.shape[0] > 1 and bool(starts[1:].any()):
        # An episode starts inside a sequence (not produced by the rollout buffer): go step by step.
        outputs = []
        for t in range(sequence.shape[0]):
            out, states = process_sequence(sequence[t], states, starts[t], rnn)
            outputs.append(out)
        return th.stack(outputs, dim=1).flatten(0, 1), states
    keep = (1.0 - starts[0]).view(1, n_seq, 1)
    if isinstance(rnn, nn.GRU):
        return _grus_from_sequence_starts([sequence], [states], keep, [rnn])[0]
    output, new_states = rnn(sequence, (keep * states[0], keep * states[1]))
    return output.transpose(0, 1).flatten(0, 1), new_states


def process_gru_sequences(
    features: list[th.Tensor], states: list[State], episode_starts: th.Tensor, rnns: list[nn.GRU]
) -> list[tuple[th.Tensor, State]]:
    """
    :func:`process_sequence` of several GRUs over the same padded sequences, in lockstep
    (:func:`~sb3_speedups.ppo_recurrent.gru.gru_sequences`) when episodes start only at sequence starts.

    :param features: each GRU's input (the same tensor twice when shared)
    :param states: each GRU's ``(h, c)``
    :param episode_starts: ``(n_seq * seq_len,)``
    :param rnns: the GRUs
    :return: each GRU's outputs and final states
    """
    n_seq = states[0][0].shape[1]
    starts = episode_starts.reshape((n_seq, -1)).swapaxes(0, 1)
    if starts.shape[0] > 1 and bool(starts[1:].any()):
        return [process_sequence(*args) for args in zip(features, states, [episode_starts] * len(rnns), rnns, strict=True)]
    keep = (1.0 - starts[0]).view(1, n_seq, 1)
    # the same features tensor gives the same sequence tensor, read once by gru_sequences
    sequences = {id(f): f.reshape((n_seq, -1, rnn.input_size)).swapaxes(0, 1) for f, rnn in zip(features, rnns, strict=True)}
    return _grus_from_sequence_starts([sequences[id(f)] for f in features], states, keep, rnns)


def _grus_from_sequence_starts(
    sequences: list[th.Tensor], states: list[State], keep: th.Tensor, rnns: list[nn.GRU]
) -> list[tuple[th.Tensor, State]]:
    """GRUs over ``(seq_len, n_seq, input)`` sequences whose states are reset (``keep`` 0) only at their start."""
    results = gru_sequences(rnns, sequences, [keep * state[0] for state in states])
    return [
        (output.transpose(0, 1).flatten(0, 1), (hidden, state[1]))
        for (output, hidden), state in zip(results, states, strict=True)
    ]


def categorical_log_prob_and_entropy(logits: th.Tensor, actions: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
    """
    ``Categorical(logits=logits).log_prob(actions)`` and ``.entropy()`` with the same operations (so the same values
    and gradients), without the distribution object and its argument checks.

    :param logits: ``(n, n_actions)`` unnormalised log-probabilities
    :param actions: action indices, ``(n,)`` (or any shape ``Categorical.log_prob`` takes)
    :return: the log-probabilities of ``actions`` and the entropies, each ``(n,)``
    """
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    # torch's broadcasting: actions of any shape that broadcasts against the batch shape, as there
    value, log_pmf = th.broadcast_tensors(actions.long().unsqueeze(-1), log_p)
    log_prob = log_pmf.gather(-1, value[..., :1]).squeeze(-1)
    p_log_p = th.clamp(log_p, min=th.finfo(log_p.dtype).min) * F.softmax(log_p, dim=-1)
    return log_prob, -p_log_p.sum(-1)


class _FastRecurrentMixin:
    """Swaps the LSTMs for GRUs when asked and uses :func:`process_sequence`."""

    # sb3-contrib annotates its version as returning two tensors; the states are really a (h, c) tuple.
    _process_sequence: Any = staticmethod(process_sequence)

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        lr_schedule: Schedule,
        *args: Any,
        rnn_type: str = "lstm",
        **kwargs: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            observation_space, action_space, lr_schedule, *args, **kwargs
        )
        self._use_rnn_type(rnn_type, lr_schedule)

    def _use_rnn_type(self, rnn_type: str, lr_schedule: Schedule) -> None:
        if rnn_type not in RNN_TYPES:
            raise ValueError(f"rnn_type must be one of {RNN_TYPES}, got {rnn_type!r}")
        policy: Any = self
        policy.rnn_type = rnn_type
        if rnn_type == "lstm":
            return
        for name in ("lstm_actor", "lstm_critic"):
            lstm = getattr(policy, name)
            if lstm is not None:
                setattr(
                    policy, name, nn.GRU(lstm.input_size, lstm.hidden_size, num_layers=lstm.num_layers, **policy.lstm_kwargs)
                )
        policy.optimizer = policy.optimizer_class(policy.parameters(), lr=lr_schedule(1), **policy.optimizer_kwargs)

    def evaluate_actions(
        self, obs: th.Tensor, actions: th.Tensor, lstm_states: RNNStates, episode_starts: th.Tensor
    ) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        """
        sb3-contrib's ``evaluate_actions`` (same values and gradients) for an actor and a critic with recurrent layers
        of their own: GRUs run in one lockstep pass, and a ``Discrete`` action's log-probability and entropy are
        computed without building distribution objects (:func:`categorical_log_prob_and_entropy`).
        """
        policy: Any = self
        if policy.lstm_critic is None:
            return super().evaluate_actions(obs, actions, lstm_states, episode_starts)  # type: ignore[misc]
        features = policy.extract_features(obs)
        pi_features, vf_features = (features, features) if policy.share_features_extractor else features
        rnns = [policy.lstm_actor, policy.lstm_critic]
        if all(isinstance(rnn, nn.GRU) for rnn in rnns):
            (latent_pi, _), (latent_vf, _) = process_gru_sequences(
                [pi_features, vf_features], [lstm_states.pi, lstm_states.vf], episode_starts, rnns
            )
        else:
            latent_pi, _ = process_sequence(pi_features, lstm_states.pi, episode_starts, policy.lstm_actor)
            latent_vf, _ = process_sequence(vf_features, lstm_states.vf, episode_starts, policy.lstm_critic)
        latent_pi = policy.mlp_extractor.forward_actor(latent_pi)
        latent_vf = policy.mlp_extractor.forward_critic(latent_vf)
        if type(policy.action_dist) is CategoricalDistribution:
            log_prob, entropy = categorical_log_prob_and_entropy(policy.action_net(latent_pi), actions)
            return policy.value_net(latent_vf), log_prob, entropy
        distribution = policy._get_action_dist_from_latent(latent_pi)
        log_prob = distribution.log_prob(actions)
        return policy.value_net(latent_vf), log_prob, distribution.entropy()

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()  # type: ignore[misc]
        if getattr(self, "rnn_type", "lstm") != "lstm":
            data["rnn_type"] = self.rnn_type  # type: ignore[attr-defined]
        return data


# (mypy: sb3-contrib's evaluate_actions takes states and episode starts, SB3's does not)
class RecurrentActorCriticPolicy(_FastRecurrentMixin, contrib.RecurrentActorCriticPolicy):  # type: ignore[misc]
    """
    :class:`sb3_contrib.common.recurrent.policies.RecurrentActorCriticPolicy` with a one-call training pass.

    :param rnn_type: ``"lstm"`` (default, as sb3-contrib) or ``"gru"`` (3 gates instead of 4: fewer parameters)
    """


class RecurrentActorCriticCnnPolicy(_FastRecurrentMixin, contrib.RecurrentActorCriticCnnPolicy):  # type: ignore[misc]
    """CNN counterpart of :class:`RecurrentActorCriticPolicy`; ``rnn_type`` as there."""


class RecurrentMultiInputActorCriticPolicy(_FastRecurrentMixin, contrib.RecurrentMultiInputActorCriticPolicy):  # type: ignore[misc]
    """Dict-observation counterpart of :class:`RecurrentActorCriticPolicy`; ``rnn_type`` as there."""


class MlpGruPolicy(RecurrentActorCriticPolicy):
    """:class:`RecurrentActorCriticPolicy` with ``rnn_type="gru"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rnn_type", "gru")
        super().__init__(*args, **kwargs)


class CnnGruPolicy(RecurrentActorCriticCnnPolicy):
    """:class:`RecurrentActorCriticCnnPolicy` with ``rnn_type="gru"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rnn_type", "gru")
        super().__init__(*args, **kwargs)


class MultiInputGruPolicy(RecurrentMultiInputActorCriticPolicy):
    """:class:`RecurrentMultiInputActorCriticPolicy` with ``rnn_type="gru"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rnn_type", "gru")
        super().__init__(*args, **kwargs)


MlpLstmPolicy = RecurrentActorCriticPolicy
CnnLstmPolicy = RecurrentActorCriticCnnPolicy
MultiInputLstmPolicy = RecurrentMultiInputActorCriticPolicy

# sb3-contrib's classes -> ours, so that files saved by either library train with the one-call pass here.
FAST_POLICIES: dict[type, type] = {
    contrib.RecurrentActorCriticPolicy: RecurrentActorCriticPolicy,
    contrib.RecurrentActorCriticCnnPolicy: RecurrentActorCriticCnnPolicy,
    contrib.RecurrentMultiInputActorCriticPolicy: RecurrentMultiInputActorCriticPolicy,
}
