"""
TRPO's update of an MLP ``ActorCriticPolicy`` by hand (:class:`HandDerivedTRPOUpdate`): the policy's natural-gradient
step (surrogate gradient, stock's conjugate gradient on the hand-derived Fisher-vector product, backtracking line
search) on the actor's range of one flat parameter buffer, then ``n_critic_updates`` epochs of value minibatches with
the flat fused Adam on the critic's range. The RNG draws (numpy's permutations, the CG's ``randn``) are stock's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch as th
from sb3_contrib.common.utils import conjugate_gradient_solver
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.actor_critic import critic_parameters, parse_actor_critic
from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.nn.optim import FlatAdam
from sb3_speedups.common.on_policy.buffers import env_major_to_time_major
from sb3_speedups.ppo.minibatches import RETURNS, MinibatchSampler
from sb3_speedups.trpo.natural_gradient import FisherVectorProduct, OutputFisher


@dataclass
class TRPOConfig:
    """Stock TRPO's step options for one ``train()`` call."""

    cg_max_steps: int
    cg_damping: float
    line_search_shrinking_factor: float
    line_search_max_iter: int
    target_kl: float
    normalize_advantage: bool
    sub_sampling_factor: int


@dataclass
class Rollout:
    """One rollout's training inputs on the training device, time-major ``[n, ...]``."""

    #: the networks' input (:attr:`ActorCriticMlp.inputs` of the observations)
    x: th.Tensor
    actions: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    n_steps: int
    n_envs: int


def actor_and_critic(policy: ActorCriticPolicy) -> tuple[list[th.Tensor], list[th.Tensor]]:
    """
    :param policy: an MLP ``ActorCriticPolicy`` (check :func:`~sb3_speedups.common.nn.actor_critic.mlp_unsupported_reason`)
    :return: the actor's parameters in the policy's order (the split flat layout's actor range) and the critic's
    """
    ac = parse_actor_critic(policy)
    assert not isinstance(ac, str)
    critic = critic_parameters(ac)
    return [p for p in policy.parameters() if all(p is not q for q in critic)], critic


def actor_order_reason(policy: ActorCriticPolicy) -> str | None:
    """
    :return: why stock's actor parameters (every parameter whose name lacks ``"value"``, in ``named_parameters``
        order) are not the split layout's actor range in that order, or ``None`` (the CG's ``randn`` follows it)
    """
    ac = parse_actor_critic(policy)
    if isinstance(ac, str):
        return ac
    critic = {id(p) for p in critic_parameters(ac)}
    named_critic = {id(p) for name, p in policy.named_parameters() if "value" in name}
    return None if critic == named_critic else "the value network's parameters are not those named 'value'"


def align_actor_adam_state(optimizer: th.optim.Optimizer, actor: Sequence[th.Tensor], critic: Sequence[th.Tensor]) -> None:
    """
    Give the actor's parameters the critic's Adam step count (zero moments where they have no Adam state).

    Stock TRPO steps Adam with the actor's gradients set to ``None``: a model it trained holds Adam state for the
    critic only, or an actor step count left behind by the critic's; the flat Adam keeps one count for all. The
    actor's Adam state is never read (Adam skips a parameter without gradient, and TRPO moves the actor by its line
    search), so aligning it changes no number.
    """
    state = optimizer.state
    steps = [state[p]["step"] for p in critic if "step" in state.get(p, {})]
    if not steps:
        return
    for p in actor:
        if "step" not in state.get(p, {}):
            state[p] = {"step": steps[0].clone(), "exp_avg": th.zeros_like(p), "exp_avg_sq": th.zeros_like(p)}
        elif float(state[p]["step"]) != float(steps[0]):
            state[p]["step"] = steps[0].clone()


class HandDerivedTRPOUpdate:
    """
    TRPO's update of an MLP ``ActorCriticPolicy`` with a hand-derived KL Hessian; building it moves the parameters
    into one flat buffer (actor range first, in stock's order) and the Adam state into a flat Adam.

    :param policy: a policy accepted by :func:`~sb3_speedups.common.on_policy.fast_paths.mlp_model_unsupported_reason`
        and :func:`actor_order_reason`, with a ``torch.optim.Adam``
    :param head: its action head
    :param fisher: the KL and Fisher of the head's family (:func:`~sb3_speedups.trpo.natural_gradient.make_output_fisher`)
    """

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead, fisher: OutputFisher) -> None:
        self.policy, self.head, self.fisher = policy, head, fisher
        self.net = ActorCriticMlp(policy, split=True, shared=False)
        self.flat = self.net.flat
        actor, critic = actor_and_critic(policy)
        self.actor = slice(0, sum(p.numel() for p in actor))
        self.critic = slice(self.net.critic_start, self.flat.data.numel())
        align_actor_adam_state(policy.optimizer, actor, critic)
        self.adam = FlatAdam(self.flat, policy.optimizer)
        self._adam_step = float(self.adam.steps[0])
        self._sampler: MinibatchSampler | None = None

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters and optimizer state still live in our flat buffers"""
        return self.policy.optimizer is self.adam.optimizer and self.flat.is_bound() and self.adam.is_bound()

    def policy_step(self, rollout: Rollout, cfg: TRPOConfig) -> tuple[float, float, bool]:
        """
        Stock's policy step: the surrogate objective's gradient, the CG direction, the largest step within
        ``target_kl`` and the backtracking line search (the actor is restored when no step is accepted).

        :return: the policy objective, the KL divergence (0 when rejected) and whether the line search succeeded
        """
        # Stock's get() draws a permutation of the rollout; its order matters only for the sub-sampled rows.
        permutation = np.random.permutation(rollout.n_steps * rollout.n_envs)
        x, actions, old_log_prob, advantages = rollout.x, rollout.actions, rollout.old_log_prob, rollout.advantages
        if cfg.sub_sampling_factor > 1:
            rows = env_major_to_time_major(permutation, rollout.n_steps, rollout.n_envs)[:: cfg.sub_sampling_factor]
            index = th.from_numpy(rows).to(x.device)
            x, actions, old_log_prob, advantages = (t[index] for t in (x, actions, old_log_prob, advantages))
        if cfg.normalize_advantage:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        n, net, head = x.shape[0], self.net, self.head
        ws = head.workspace(n, x.device)
        train_actions = head.training_actions(actions)
        log_prob, neg_entropy = th.empty(n, device=x.device), th.empty(n, device=x.device)

        def ratio_at_params() -> tuple[th.Tensor, th.Tensor]:
            """:return: the actor's output and the probability ratios at the present parameters"""
            out = net.forward_part(x, 0)
            head.forward(ws, out, train_actions, net.log_std, log_prob, neg_entropy)
            return out, th.exp(log_prob - old_log_prob)

        out, ratio = ratio_at_params()
        self.fisher.set_old(out, net.log_std)
        policy_objective = (advantages * ratio).mean()
        # d objective / d log pi = A * ratio / n, back through the head and the actor into the flat gradient
        d_out = net.d_out_buffer(n)
        head.backward(ws, advantages * ratio / n, 0.0, d_out, net.grad_log_std)
        net.backward_part(d_out, 0)
        gradient = self.flat.grad[self.actor].clone()
        fvp = FisherVectorProduct(net, self.fisher, self.actor, cfg.cg_damping, n)
        direction = conjugate_gradient_solver(fvp, gradient, max_iter=cfg.cg_max_steps)
        max_step = math.sqrt(2 * cfg.target_kl / float(th.matmul(direction, fvp(direction))))
        params = self.flat.data[self.actor]
        original, scaled = params.clone(), th.empty_like(params)
        coefficient = 1.0
        for _ in range(cfg.line_search_max_iter):
            th.mul(direction, coefficient * max_step, out=scaled)
            th.add(original, scaled, out=params)
            out, ratio = ratio_at_params()
            new_objective = (advantages * ratio).mean()
            kl = self.fisher.kl(out, net.log_std)
            if (kl < cfg.target_kl) and (new_objective > policy_objective):
                return new_objective.item(), kl.item(), True
            coefficient *= cfg.line_search_shrinking_factor
        params.copy_(original)
        return policy_objective.item(), 0.0, False

    def critic_epochs(self, rollout: Rollout, batch_size: int, n_epochs: int) -> float:
        """
        Stock's critic update: ``n_epochs`` epochs of shuffled minibatches, each an MSE step of the value network
        and value net with Adam on the critic's range only (stock's actor gradients are ``None``).

        :return: the mean of the minibatches' value losses
        """
        sampler = self._sampler
        if sampler is None or sampler.n != rollout.x.shape[0] or sampler.batch_size != batch_size:
            sampler = self._sampler = MinibatchSampler(
                rollout.n_steps, rollout.n_envs, batch_size, rollout.x.device, normalize=None
            )
        scalars = rollout.returns.new_zeros(4, rollout.x.shape[0])
        scalars[RETURNS] = rollout.returns
        sampler.load(rollout.x, {}, scalars)
        net = self.net
        losses = []
        for _ in range(n_epochs):
            sampler.shuffle()
            for batch in sampler.minibatches():
                m = batch.returns.shape[0]
                values = net.forward_part(batch.observations, 1)  # type: ignore[arg-type]  # one tensor: x rows
                err = values - batch.returns
                losses.append(th.dot(err, err) / m)
                net.backward_part(err.mul_(2.0 / m).unsqueeze(1), 1)
                self._adam_step += 1
                lr, beta1, beta2, eps = self.adam.hyperparameters()
                self.adam.step_range(self.critic, None, lr, beta1, beta2, eps, self._adam_step)
        return float(np.mean(th.stack(losses).tolist())) if losses else float("nan")
