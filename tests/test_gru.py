"""The hand-derived GRU layer against nn.GRU: outputs, gradients, state resets at episode starts, fallbacks."""

from __future__ import annotations

import pytest
import torch as th
from torch import nn

from sb3_speedups.ppo_recurrent.gru import gru_sequence, gru_sequences, gru_unsupported_reason
from sb3_speedups.ppo_recurrent.policies import process_sequence


def assert_close_relative(ours: th.Tensor, reference: th.Tensor, tol: float = 1e-6) -> None:
    """Equal within ``tol`` of the reference's largest magnitude (float32 sums over many rows round in the last bits)."""
    th.testing.assert_close(ours, reference, rtol=0.0, atol=tol * max(float(reference.detach().abs().max()), 1.0))


def _outputs_and_gradients(run, rnn: nn.GRU, x: th.Tensor, h0: th.Tensor) -> list[th.Tensor]:
    gen = th.Generator().manual_seed(1)
    out, h_n = run(x, h0)
    loss = (out * th.randn(out.shape, generator=gen)).sum() + (h_n * th.randn(h_n.shape, generator=gen)).sum()
    return [out, h_n, *th.autograd.grad(loss, [x, h0, *rnn.parameters()])]


@pytest.mark.parametrize(
    ("num_layers", "input_size", "hidden", "seq_len", "n"), [(1, 2, 64, 32, 12), (1, 3, 8, 1, 5), (2, 4, 16, 9, 3)]
)
def test_gru_sequence_equals_nn_gru(num_layers: int, input_size: int, hidden: int, seq_len: int, n: int) -> None:
    th.manual_seed(0)
    rnn = nn.GRU(input_size, hidden, num_layers=num_layers)
    x = th.randn(seq_len, n, input_size, requires_grad=True)
    h0 = th.randn(num_layers, n, hidden, requires_grad=True)
    assert gru_unsupported_reason(rnn, x) is None
    ours = _outputs_and_gradients(lambda x, h: gru_sequence(rnn, x, h), rnn, x, h0)
    reference = _outputs_and_gradients(rnn, rnn, x, h0)
    for a, b in zip(ours, reference, strict=True):
        assert_close_relative(a, b)


@pytest.mark.parametrize(("num_layers", "shared_input"), [(1, True), (2, False)])
def test_gru_sequences_in_lockstep_equal_nn_gru(num_layers: int, shared_input: bool) -> None:
    """Two GRUs of one shape (an actor's and a critic's) run as one batch: each equals its own nn.GRU."""
    th.manual_seed(0)
    rnns = [nn.GRU(3, 16, num_layers=num_layers) for _ in range(2)]
    x = th.randn(7, 5, 3, requires_grad=True)
    xs = [x, x] if shared_input else [x, th.randn(7, 5, 3, requires_grad=True)]
    h0s = [th.randn(num_layers, 5, 16, requires_grad=True) for _ in range(2)]
    gen = th.Generator().manual_seed(1)
    weights = [th.randn(7, 5, 16, generator=gen) for _ in range(2)]

    def outputs_and_gradients(results: list[tuple[th.Tensor, th.Tensor]]) -> list[th.Tensor]:
        loss = sum((out * w).sum() + h_n.sum() for (out, h_n), w in zip(results, weights, strict=True))
        leaves = [*dict.fromkeys(xs), *h0s, *(p for rnn in rnns for p in rnn.parameters())]
        return [t for result in results for t in result] + list(th.autograd.grad(loss, leaves))

    ours = outputs_and_gradients(gru_sequences(rnns, xs, h0s))
    reference = outputs_and_gradients([rnn(x, h0) for rnn, x, h0 in zip(rnns, xs, h0s, strict=True)])
    for a, b in zip(ours, reference, strict=True):
        assert_close_relative(a, b)


def test_gru_sequences_of_different_shapes_run_one_by_one() -> None:
    th.manual_seed(0)
    rnns, x = [nn.GRU(3, 8), nn.GRU(3, 4)], th.randn(4, 2, 3)
    results = gru_sequences(rnns, [x, x], [th.zeros(1, 2, 8), th.zeros(1, 2, 4)])
    for (out, h_n), rnn, hidden in zip(results, rnns, (8, 4), strict=True):
        expected, expected_h = rnn(x, th.zeros(1, 2, hidden))
        assert_close_relative(out, expected)
        assert_close_relative(h_n, expected_h)


def _step_by_step_reference(
    features: th.Tensor, h: th.Tensor, starts: th.Tensor, rnn: nn.GRU, n_seq: int
) -> tuple[th.Tensor, th.Tensor]:
    """nn.GRU one step at a time, the state zeroed where an episode starts (sb3-contrib's semantics)."""
    sequence = features.reshape(n_seq, -1, rnn.input_size).swapaxes(0, 1)
    starts = starts.reshape(n_seq, -1).swapaxes(0, 1)
    outputs = []
    for t in range(sequence.shape[0]):
        out, h = rnn(sequence[t : t + 1], (1.0 - starts[t]).view(1, n_seq, 1) * h)
        outputs.append(out[0])
    return th.stack(outputs, dim=1).flatten(0, 1), h


@pytest.mark.parametrize("mid_episode_start", [False, True])
def test_process_sequence_gru_resets_states_at_episode_starts(mid_episode_start: bool) -> None:
    th.manual_seed(0)
    n_seq, seq_len, rnn = 4, 6, nn.GRU(3, 8)
    features = th.randn(n_seq * seq_len, 3, requires_grad=True)
    h0 = th.randn(1, n_seq, 8)
    starts = th.zeros(n_seq, seq_len)
    starts[::2, 0] = 1.0
    if mid_episode_start:
        starts[1, 3] = 1.0
    starts = starts.flatten()

    def ours(x: th.Tensor, h: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        out, states = process_sequence(x, (h, th.zeros_like(h)), starts, rnn)
        return out, states[0]

    got = _outputs_and_gradients(ours, rnn, features, h0.clone().requires_grad_(True))
    want = _outputs_and_gradients(
        lambda x, h: _step_by_step_reference(x, h, starts, rnn, n_seq), rnn, features, h0.clone().requires_grad_(True)
    )
    for a, b in zip(got, want, strict=True):
        assert_close_relative(a, b)
    # a reset state contributes nothing: zero gradient for the sequences whose episode starts at their first step
    assert bool((got[3][0, ::2] == 0).all())


def test_gru_sequence_hands_other_configurations_to_nn_gru() -> None:
    x = th.randn(5, 2, 3)
    assert gru_unsupported_reason(nn.GRU(3, 4, bias=False), x) is not None
    assert gru_unsupported_reason(nn.GRU(3, 4, batch_first=True), x) is not None
    assert gru_unsupported_reason(nn.GRU(3, 4, num_layers=2, dropout=0.5), x) is not None
    assert gru_unsupported_reason(nn.GRU(3, 4, num_layers=2, dropout=0.5).eval(), x) is None
    assert gru_unsupported_reason(nn.GRU(3, 4).double(), x.double()) is not None
    rnn = nn.GRU(3, 4, bias=False)
    out, h_n = gru_sequence(rnn, x, th.zeros(1, 2, 4))
    expected, expected_h = rnn(x, th.zeros(1, 2, 4))
    assert th.equal(out, expected) and th.equal(h_n, expected_h)


def test_first_train_of_recurrent_ppo_gru_within_1e_6_of_nn_gru(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rollout and one train() of the RL Zoo's CartPoleNoVel-v1 config: the same parameters as with nn.GRU, up to
    rounding (the collection is the same either way; only the training pass's op order differs)."""
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_speedups.envs  # noqa: F401  (registers CartPoleNoVel-v1)
    from sb3_speedups import RecurrentPPO
    from sb3_speedups.ppo_recurrent import policies

    def first_train() -> dict[str, th.Tensor]:
        model = RecurrentPPO(
            "MlpGruPolicy",
            make_vec_env("CartPoleNoVel-v1", n_envs=8, seed=0),
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=1e-3,
            policy_kwargs=dict(ortho_init=False, activation_fn=nn.ReLU, lstm_hidden_size=64, net_arch=dict(pi=[64], vf=[64])),
            seed=0,
        )
        model.learn(256)
        return {name: p.detach().clone() for name, p in model.policy.named_parameters()}

    ours = first_train()
    monkeypatch.setattr(
        policies, "gru_sequences", lambda rnns, xs, h0s: [r(x, h) for r, x, h in zip(rnns, xs, h0s, strict=True)]
    )
    reference = first_train()
    assert ours.keys() == reference.keys()
    differences = {name: float((ours[name] - reference[name]).abs().max()) for name in ours}
    print("max difference after the first train():", max(differences.values()))
    assert max(differences.values()) <= 1e-6, differences
    assert any(name.startswith("lstm_actor.weight_hh") for name in ours)  # the nn.GRU parameters, as sb3-contrib saves them


def test_gru_layers_of_one_shape_keep_their_buffers_apart_until_their_backward() -> None:
    """Two forwards of one shape before either backward: each backward reads its own forward's gates; a second
    backward through a graph whose buffers a later forward took raises instead of reading them."""
    th.manual_seed(0)
    rnn, x = nn.GRU(3, 8), th.randn(5, 2, 3)
    h0s = [th.randn(1, 2, 8, requires_grad=True) for _ in range(2)]
    outs = [gru_sequence(rnn, x, h0)[0].sum() for h0 in h0s]
    got = [th.autograd.grad(out, [h0]) for out, h0 in zip(reversed(outs), reversed(h0s), strict=True)]
    want = [th.autograd.grad(rnn(x, h0)[0].sum(), [h0]) for h0 in reversed(h0s)]
    for a, b in zip(got, want, strict=True):
        assert_close_relative(a[0], b[0])
    out = gru_sequence(rnn, x, h0s[0])[0].sum()
    th.autograd.grad(out, [h0s[0]], retain_graph=True)
    gru_sequence(rnn, x, h0s[1])[0].sum()  # takes the same shape's buffers, now free
    with pytest.raises(RuntimeError, match="reused by a later forward"):
        th.autograd.grad(out, [h0s[0]])


def test_gru_buffers_made_under_inference_mode_serve_training_after_it() -> None:
    """Acting runs under inference mode; the buffers it leaves in the cache must still take a training forward."""
    th.manual_seed(0)
    rnn = nn.GRU(4, 8)
    x, h0 = th.randn(5, 3, 4), th.zeros(1, 3, 8)
    with th.inference_mode():
        gru_sequences([rnn], [x], [h0])
    x_train = x.clone().requires_grad_(True)
    out, _ = gru_sequences([rnn], [x_train], [h0])[0]
    out.sum().backward()
    reference, _ = rnn(x, h0)
    assert_close_relative(out.detach(), reference.detach())
    assert x_train.grad is not None and rnn.weight_hh_l0.grad is not None
