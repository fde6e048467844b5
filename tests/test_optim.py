"""The flat parameter storage and the flat Adam and RMSprop, against torch's optimizers and the stock policy's state dict."""

import copy

import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.torch_utils import KeptScalar
from sb3_speedups.common.nn.optim import (
    FLUSH_SUBNORMALS_EVERY,
    FlatAdam,
    FlatRMSprop,
    adam_unsupported_reason,
    flat_optimizer_unsupported_reason,
    rmsprop_unsupported_reason,
)

DISCRETE, BOX = spaces.Discrete(3), spaces.Box(-2, 2, (2,))


def make_policy(action_space: spaces.Space) -> ActorCriticPolicy:
    return ActorCriticPolicy(spaces.Box(-1, 1, (5,)), action_space, lambda _: 1e-3)


def test_flat_parameters_keep_module_and_state_dict():
    policy = make_policy(DISCRETE)
    state = copy.deepcopy(policy.state_dict())
    params = list(policy.parameters())
    flat = FlatParameters(params, list(reversed(params)))
    assert all(p is q for p, q in zip(params, policy.parameters(), strict=True)) and flat.is_bound()
    for key, value in policy.state_dict().items():
        th.testing.assert_close(value, state[key], rtol=0, atol=0)
    flat.data.mul_(0.0)  # the parameters are views: they see it
    assert all(float(p.detach().abs().sum()) == 0.0 for p in policy.parameters())
    policy.load_state_dict(state)  # loading copies into the views
    assert flat.is_bound() and float(flat.data.abs().sum()) > 0
    with pytest.raises(ValueError, match="side by side"):
        flat.stacked([params[0], params[2]])


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_flat_adam_matches_torch_adam_and_saves_as_stock(max_norm):
    th.manual_seed(0)
    ours_policy = make_policy(BOX)
    stock_policy = copy.deepcopy(ours_policy)
    flat = FlatParameters(list(ours_policy.parameters()))
    adam = FlatAdam(flat, ours_policy.optimizer)
    x, actions = th.randn(32, 5), th.randn(32, 2)

    def loss_of(policy):
        values, log_prob, entropy = policy.evaluate_actions(x, actions)
        return values.pow(2).mean() - log_prob.mean() - 0.1 * entropy.mean()

    for _ in range(5):
        for policy in (ours_policy, stock_policy):
            policy.optimizer.zero_grad() if policy is stock_policy else flat.grad.zero_()
            loss = loss_of(policy)
            if policy is ours_policy:
                grads = th.autograd.grad(loss, list(policy.parameters()))
                for p, g in zip(policy.parameters(), grads, strict=True):
                    flat.grad_of(p).copy_(g)
                divisor = flat.clip_divisor(max_norm)
                # on the CPU: a divisor when clipping is needed (applied inside the fused kernel), else None
                assert (divisor is None) == (max_norm == 1e3) and (divisor is None or float(divisor) > 1.0)
                adam.step(divisor)
            else:
                loss.backward()
                th.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
                policy.optimizer.step()
    for p, q in zip(ours_policy.parameters(), stock_policy.parameters(), strict=True):
        th.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    ours_state, stock_state = ours_policy.optimizer.state_dict(), stock_policy.optimizer.state_dict()
    assert ours_state["state"].keys() == stock_state["state"].keys()
    for key, state in stock_state["state"].items():
        assert float(ours_state["state"][key]["step"]) == float(state["step"]) == 5
        th.testing.assert_close(ours_state["state"][key]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-4, atol=1e-9)
    # A stock optimizer loading our state steps each parameter once per step (separate step counters).
    fresh = th.optim.Adam(stock_policy.parameters(), lr=1e-3)
    fresh.load_state_dict(ours_state)
    stock_policy.optimizer.zero_grad()
    loss_of(stock_policy).backward()
    fresh.step()
    assert all(float(s["step"]) == 6 for s in fresh.state.values())
    # Loading state into the optimizer replaces our views: FlatAdam notices, a new one imports the state.
    assert adam.is_bound()
    ours_policy.optimizer.load_state_dict(stock_state)
    assert not adam.is_bound()
    again = FlatAdam(flat, ours_policy.optimizer)
    assert again.is_bound() and float(again.steps[0]) == 5


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e3])
def test_taken_gradients_step_as_the_flat_buffer_and_as_stock(max_norm):
    # take_grads: autograd stores fresh gradients and Adam steps over them, instead of the zeroed flat buffer
    th.manual_seed(0)
    policies = [make_policy(BOX) for _ in range(3)]
    for other in policies[1:]:
        other.load_state_dict(policies[0].state_dict())
    flat_policy, taken_policy, stock_policy = policies
    flat_step = FlatOptimizerStep(flat_policy, flat_policy.optimizer)
    taken_step = FlatOptimizerStep(taken_policy, taken_policy.optimizer, take_grads=True)
    assert taken_step.take_grads and not flat_step.take_grads
    x, actions = th.randn(32, 5), th.randn(32, 2)

    def loss_of(policy):
        values, log_prob, _ = policy.evaluate_actions(x, actions)
        return values.pow(2).mean() - log_prob.mean()

    for _ in range(5):
        for step, policy in ((flat_step, flat_policy), (taken_step, taken_policy)):
            step.backward(loss_of(policy))
            step.step(max_norm)
        stock_policy.optimizer.zero_grad()
        loss_of(stock_policy).backward()
        if max_norm is not None:
            th.nn.utils.clip_grad_norm_(stock_policy.parameters(), max_norm)
        stock_policy.optimizer.step()
    for p, q, r in zip(taken_policy.parameters(), flat_policy.parameters(), stock_policy.parameters(), strict=True):
        # float32 rounding apart: the fused kernel runs each tensor's short tail through its scalar code, and a
        # clipping norm is summed in another order (stock's per-tensor norm of norms here)
        th.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        th.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)  # torch's Adam is another kernel
    # after a step the parameters hold their gradients, as after stock's; none are views of the flat buffer
    assert all(
        p.grad is not None and p.grad.data_ptr() != taken_step.flat.grad_of(p).data_ptr() for p in taken_policy.parameters()
    )
    assert taken_step.is_bound(taken_policy.optimizer)
    # zero_grad (set_to_none) between steps changes nothing
    taken_policy.optimizer.zero_grad()
    taken_step.backward(loss_of(taken_policy))
    taken_step.step(max_norm)
    assert float(taken_step.adam.steps[0]) == 6


def test_taken_gradients_step_a_parameter_the_loss_does_not_reach_as_the_flat_buffer():
    th.manual_seed(0)
    modules = [th.nn.Sequential(th.nn.Linear(3, 4), th.nn.Linear(4, 2)) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    steps = [
        FlatOptimizerStep(m, th.optim.Adam(m.parameters(), lr=0.1), take_grads=take)
        for m, take in zip(modules, (False, True), strict=True)
    ]
    x = th.randn(8, 3)
    for _ in range(3):
        for module, step in zip(modules, steps, strict=True):
            step.backward(module[0](x).pow(2).sum())  # the second layer gets no gradient: a zero one, on both paths
            step.step(None)
    for p, q in zip(*(m.parameters() for m in modules), strict=True):
        th.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert modules[1][1].weight.grad is None and th.equal(modules[1][1].weight, modules[0][1].weight)


@pytest.mark.parametrize("eps, flushed", [(1e-8, True), (1e-12, False)])
def test_flat_adam_flushes_subnormal_moments_without_changing_parameters(eps, flushed):
    # Entries whose gradient stops (dead units) decay into subnormal numbers, which the CPU handles slowly.
    th.manual_seed(0)
    ours, unflushed, stock = (th.nn.Parameter(th.randn(64)) for _ in range(3))
    with th.no_grad():
        unflushed.copy_(ours)
        stock.copy_(ours)
    stock_opt = th.optim.Adam([stock], lr=1e-3, eps=eps)
    flat, flat_ref = FlatParameters([ours]), FlatParameters([unflushed])
    adam = FlatAdam(flat, th.optim.Adam([ours], lr=1e-3, eps=eps))
    reference = FlatAdam(flat_ref, th.optim.Adam([unflushed], lr=1e-3, eps=eps))
    reference._on_cpu = False  # the flush only runs on CPUs: the same fused steps, never flushed
    tiny = th.finfo(th.float32).tiny
    dead = th.arange(64) < 32
    for step in range(1, 1200):
        grad = th.randn(64) * 1e-3
        grad[dead] = 1e-36 if step == 1 else 0.0  # tiny once, then nothing: m falls below `tiny` within steps
        flat.grad.copy_(grad)
        adam.step()
        flat_ref.grad.copy_(grad)
        reference.step()
        stock.grad = grad.clone()
        stock_opt.step()
        if step % FLUSH_SUBNORMALS_EVERY == 0:
            m = adam.exp_avg
            subnormal = int(((m != 0) & (m.abs() < tiny)).sum())
            if flushed:
                assert subnormal == 0
            if step == FLUSH_SUBNORMALS_EVERY * 2:
                # the unflushed steps and stock keep them (the case the flush is for); with a tiny eps ours keeps them
                for kept in (reference.exp_avg, stock_opt.state[stock]["exp_avg"]):
                    assert int(((kept != 0) & (kept.abs() < tiny)).sum()) == 32
                assert (subnormal == 0) == flushed
    # The flush changes no parameter; torch's own Adam (another kernel) agrees to rounding.
    assert th.equal(ours.detach(), unflushed.detach())
    assert th.allclose(ours, stock, rtol=1e-5, atol=1e-7)


def test_adam_support_checks():
    policy = make_policy(DISCRETE)
    params = list(policy.parameters())
    assert adam_unsupported_reason(policy.optimizer, params) is None
    assert "SGD" in adam_unsupported_reason(th.optim.SGD(params, lr=0.1), params)
    assert "amsgrad" in adam_unsupported_reason(th.optim.Adam(params, amsgrad=True), params)


def make_rmsprop_policy(action_space: spaces.Space) -> ActorCriticPolicy:
    """A policy with the optimizer stock A2C gives it (``use_rms_prop=True``)."""
    kwargs = dict(alpha=0.99, eps=1e-5, weight_decay=0)
    return ActorCriticPolicy(
        spaces.Box(-1, 1, (5,)), action_space, lambda _: 7e-4, optimizer_class=th.optim.RMSprop, optimizer_kwargs=kwargs
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_flat_rmsprop_matches_torch_rmsprop_and_saves_as_stock(max_norm):
    th.manual_seed(0)
    ours_policy = make_rmsprop_policy(BOX)
    stock_policy = copy.deepcopy(ours_policy)
    flat = FlatParameters(list(ours_policy.parameters()))
    rmsprop = FlatRMSprop(flat, ours_policy.optimizer)
    x, actions = th.randn(32, 5), th.randn(32, 2)

    def loss_of(policy):
        values, log_prob, entropy = policy.evaluate_actions(x, actions)
        return values.pow(2).mean() - log_prob.mean() - 0.1 * entropy.mean()

    for _ in range(5):
        grads = th.autograd.grad(loss_of(ours_policy), list(ours_policy.parameters()))
        for p, g in zip(ours_policy.parameters(), grads, strict=True):
            flat.grad_of(p).copy_(g)
        rmsprop.step(flat.clip_divisor(max_norm))
        stock_policy.optimizer.zero_grad()
        loss_of(stock_policy).backward()
        th.nn.utils.clip_grad_norm_(stock_policy.parameters(), max_norm)
        stock_policy.optimizer.step()
    for p, q in zip(ours_policy.parameters(), stock_policy.parameters(), strict=True):
        if max_norm == 1e3:  # unclipped: torch's own element-wise operations on one flat tensor, the same bits
            assert th.equal(p, q)
        th.testing.assert_close(p, q, rtol=0, atol=1e-6)
    ours_state, stock_state = ours_policy.optimizer.state_dict(), stock_policy.optimizer.state_dict()
    assert ours_state["state"].keys() == stock_state["state"].keys()
    for key, state in stock_state["state"].items():
        assert ours_state["state"][key].keys() == state.keys()
        assert float(ours_state["state"][key]["step"]) == float(state["step"]) == 5
        th.testing.assert_close(ours_state["state"][key]["square_avg"], state["square_avg"], rtol=1e-4, atol=1e-9)
    # A stock optimizer loads our state and steps on; loading state into ours unbinds it, a new one imports it.
    fresh = th.optim.RMSprop(stock_policy.parameters(), lr=7e-4, alpha=0.99, eps=1e-5)
    fresh.load_state_dict(ours_state)
    stock_policy.optimizer.zero_grad()
    loss_of(stock_policy).backward()
    fresh.step()
    assert all(float(s["step"]) == 6 for s in fresh.state.values())
    assert rmsprop.is_bound()
    ours_policy.optimizer.load_state_dict(stock_state)
    assert not rmsprop.is_bound()
    again = FlatRMSprop(flat, ours_policy.optimizer)
    assert again.is_bound() and float(again.steps[0]) == 5


def test_rmsprop_support_checks_and_the_flat_step_of_an_autograd_loss():
    policy = make_rmsprop_policy(DISCRETE)
    params = list(policy.parameters())
    assert rmsprop_unsupported_reason(policy.optimizer, params) is None
    assert flat_optimizer_unsupported_reason(policy.optimizer, params) is None
    assert "momentum" in rmsprop_unsupported_reason(th.optim.RMSprop(params, momentum=0.9), params)
    assert "centered" in rmsprop_unsupported_reason(th.optim.RMSprop(params, centered=True), params)
    assert "weight_decay" in rmsprop_unsupported_reason(th.optim.RMSprop(params, weight_decay=0.1), params)
    assert "Adam or torch.optim.RMSprop" in flat_optimizer_unsupported_reason(th.optim.SGD(params, lr=0.1), params)
    # PPO's autograd step keeps the stock calls for RMSprop; A2C's (rmsprop=True) runs it flat
    assert FlatOptimizerStep(policy, policy.optimizer).flat is None
    step = FlatOptimizerStep(policy, policy.optimizer, rmsprop=True)
    assert isinstance(step.flat_optimizer, FlatRMSprop) and step.adam is None and step.is_bound(policy.optimizer)


def test_kept_scalar_computes_as_the_python_number() -> None:
    x = th.randn(1000)
    kept = KeptScalar()
    for value in (0.99, 1e-5, -1.0 / 3.0, 2.0 * 0.5 / 7.0, 0.99):  # numbers float32 rounds, and a repeat
        assert th.equal(th.mul(x, kept(value)), th.mul(x, value))
        assert th.equal(x.clone().add_(kept(value)), x.clone().add_(value))
    assert kept.value == 0.99 and float(kept.tensor) == pytest.approx(0.99)
