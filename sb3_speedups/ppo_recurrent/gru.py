"""
The training pass of GRUs over padded sequences, with the backward derived by hand.

torch's CPU ``nn.GRU`` runs each time step as separate gate operations that autograd records one by one, so its
backward replays hundreds of tiny kernels per sequence (its LSTM has one fused kernel). Here a layer's forward is one
input projection for all steps, then per step one in-place recurrent product and four in-place gate operations; the
backward derives every gate slope for all steps at once from the kept gates, runs the time loop with one product and
one multiply per step, and computes each weight gradient as one product over all steps. Several GRUs of one shape
over the same sequences (a policy's actor and critic) run in lockstep as one batch of products, so the per-step cost,
mostly the fixed cost of each small operation, is paid once for all of them. With ``r, z`` the reset and update gates,
``n = tanh(gi_n + r * gh_n)`` and ``h_t = (1 - z) * n + z * h_{t-1}``:
``dh_{t-1} = z * dh_t + [dh_t * slope] @ W_hh`` with ``slope = [(1 - z)(1 - n^2) gh_n r(1 - r), (h_{t-1} - n) z(1 - z),
(1 - z)(1 - n^2) r]``. Results equal ``nn.GRU``'s up to float rounding; the parameters stay the modules', so saved
models are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch as th
from torch import nn
from torch.autograd.function import once_differentiable

WEIGHT_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def gru_unsupported_reason(rnn: nn.GRU, sequence: th.Tensor) -> str | None:
    """:return: why :func:`gru_sequence` hands ``rnn`` to ``nn.GRU`` itself, or ``None`` when it runs it"""
    if sequence.device.type != "cpu":
        return "not on the CPU (the accelerator's GRU kernels are fused)"
    if rnn.batch_first or rnn.bidirectional or not rnn.bias:
        return "not a plain unidirectional GRU with biases"
    if rnn.dropout > 0.0 and rnn.training:
        return "dropout between layers"
    if sequence.dtype != th.float32 or any(w is None or w.dtype != th.float32 for w in rnn._flat_weights):
        return "not float32"
    return None


def gru_sequence(rnn: nn.GRU, sequence: th.Tensor, h0: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
    """
    ``rnn(sequence, h0)`` with :class:`GruLayer` for each layer where :func:`gru_unsupported_reason` allows.

    :param rnn: the GRU (not batch-first)
    :param sequence: ``(seq_len, n_seq, input_size)``
    :param h0: ``(n_layers, n_seq, hidden)``
    :return: the outputs ``(seq_len, n_seq, hidden)`` and the final states ``(n_layers, n_seq, hidden)``
    """
    return gru_sequences([rnn], [sequence], [h0])[0]


def _lockstep(rnns: Sequence[nn.GRU], sequences: Sequence[th.Tensor]) -> bool:
    first = rnns[0]
    return all(
        (rnn.input_size, rnn.hidden_size, rnn.num_layers) == (first.input_size, first.hidden_size, first.num_layers)
        and sequence.shape == sequences[0].shape
        for rnn, sequence in zip(rnns, sequences, strict=True)
    )


def _stacked(tensors: list[th.Tensor]) -> th.Tensor:
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else th.stack(tensors)


def gru_sequences(
    rnns: Sequence[nn.GRU], sequences: Sequence[th.Tensor], h0s: Sequence[th.Tensor]
) -> list[tuple[th.Tensor, th.Tensor]]:
    """
    :func:`gru_sequence` of each GRU, in lockstep where they have one shape (a sequence passed twice as the same
    tensor is read once).

    :param rnns: the GRUs
    :param sequences: each GRU's ``(seq_len, n_seq, input_size)`` input
    :param h0s: each GRU's ``(n_layers, n_seq, hidden)`` initial state
    :return: each GRU's outputs and final states
    """
    if len(rnns) > 1 and not _lockstep(rnns, sequences):
        return [gru_sequence(*args) for args in zip(rnns, sequences, h0s, strict=True)]
    if any(gru_unsupported_reason(rnn, sequence) is not None for rnn, sequence in zip(rnns, sequences, strict=True)):
        return [rnn(sequence, h0) for rnn, sequence, h0 in zip(rnns, sequences, h0s, strict=True)]
    k, (seq_len, n, _) = len(rnns), sequences[0].shape
    if all(sequence is sequences[0] for sequence in sequences):
        x = sequences[0].reshape(1, seq_len * n, -1).expand(k, -1, -1)
    else:
        x = th.stack([sequence.reshape(seq_len * n, -1) for sequence in sequences])
    finals = []
    for layer in range(rnns[0].num_layers):
        weights = [_stacked([getattr(rnn, f"{name}_l{layer}") for rnn in rnns]) for name in WEIGHT_NAMES]
        out = GruLayer.apply(x, _stacked([h0[layer] for h0 in h0s]), *weights)
        finals.append(out[-1])
        x = out.transpose(0, 1).reshape(k, seq_len * n, -1)
    return [(out[:, i], th.stack([final[i] for final in finals])) for i in range(k)]


class GruLayer(th.autograd.Function):
    """
    ``k`` GRU layers of one shape in lockstep over ``seq_len`` steps of ``n`` sequences: inputs ``(k, seq_len * n,
    input)`` (step-major rows), initial states ``(k, n, hidden)``, weights stacked on a first axis of size ``k``;
    outputs ``(seq_len, k, n, hidden)``, with a hand-derived backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: th.Tensor, h0: th.Tensor, w_ih: th.Tensor, w_hh: th.Tensor, b_ih: th.Tensor, b_hh: th.Tensor
    ) -> th.Tensor:
        k, n, hidden = h0.shape
        seq_len, h2 = x.shape[1] // n, 2 * hidden
        gi = th.baddbmm(b_ih.unsqueeze(1), x, w_ih.transpose(1, 2)).view(k, seq_len, n, 3 * hidden).transpose(0, 1)
        # Per step: what the recurrent product adds to (r, z: input part and both biases; n: its recurrent bias),
        # then, in place, r and z and n's recurrent pre-activation, kept for the backward.
        gates = x.new_empty((seq_len, k, n, 3 * hidden))
        th.add(gi[..., :h2], b_hh[:, None, :h2], out=gates[..., :h2])
        gates[..., h2:] = b_hh[:, None, h2:]
        new = x.new_empty((seq_len, k, n, hidden))
        out = x.new_empty((seq_len, k, n, hidden))
        w_hh_t, h = w_hh.transpose(1, 2).contiguous(), h0
        # every step's views made in a few calls: slicing inside the loop costs as much as the arithmetic
        steps = zip(
            gates.unbind(0),
            gates[..., :h2].unbind(0),
            gates[..., :hidden].unbind(0),
            gates[..., hidden:h2].unbind(0),
            gates[..., h2:].unbind(0),
            gi[..., h2:].unbind(0),
            new.unbind(0),
            out.unbind(0),
            strict=True,
        )
        for gates_t, rz_t, r_t, z_t, gh_n_t, gi_n_t, new_t, out_t in steps:
            gates_t.baddbmm_(h, w_hh_t)
            rz_t.sigmoid_()
            th.addcmul(gi_n_t, gh_n_t, r_t, out=new_t).tanh_()
            h = th.lerp(new_t, h, z_t, out=out_t)  # (1 - z) * n + z * h
        ctx.save_for_backward(x, h0, w_ih, w_hh, out)
        ctx.gates, ctx.new = gates, new
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: th.Tensor) -> tuple[th.Tensor | None, ...]:  # type: ignore[override]
        x, h0, w_ih, w_hh, out = ctx.saved_tensors
        seq_len, k, n, hidden = out.shape
        h2, rows = 2 * hidden, seq_len * n
        gates, new = ctx.gates, ctx.new
        r, z, gh_n = gates[..., :hidden], gates[..., hidden:h2], gates[..., h2:]
        h_prev = th.cat([h0.unsqueeze(0), out[:-1]])
        d_new = (1.0 - z).mul_(1.0 - new * new)
        # d(recurrent pre-activations r, z, n of step t) = d(out_t) * slope, and d(out_t)/d(h_{t-1}) outside the
        # recurrent product is z: [slope_r, slope_z, slope_n, z] times [W_hh; I] is one product per step.
        slope = gates.new_empty((seq_len, k, n, 4, hidden))
        th.mul(d_new, gh_n, out=slope[..., 0, :]).mul_(r).mul_(1.0 - r)
        th.sub(h_prev, new, out=slope[..., 1, :]).mul_(z).mul_(1.0 - z)
        th.mul(d_new, r, out=slope[..., 2, :])
        slope[..., 3, :] = z
        eye = th.eye(hidden, dtype=w_hh.dtype, device=w_hh.device).expand(k, hidden, hidden)
        w_hh_eye = th.cat([w_hh, eye], dim=1)
        d_gh = th.empty_like(slope)
        # d_states[t + 1]: d(loss)/d(out_t), through every later step once the loop has passed t; d_states[0]: d/d(h0)
        d_states = th.cat([grad_out.new_zeros((1, k, n, hidden)), grad_out])
        d_steps, d_steps_4 = d_states.unbind(0), d_states.unsqueeze(3).unbind(0)
        slopes, d_ghs, d_gh_rows = slope.unbind(0), d_gh.unbind(0), d_gh.view(seq_len, k, n, 4 * hidden).unbind(0)
        for t in range(seq_len - 1, -1, -1):
            th.mul(d_steps_4[t + 1], slopes[t], out=d_ghs[t])
            d_steps[t].baddbmm_(d_gh_rows[t], w_hh_eye)
        # per GRU, step-major rows: (k, seq_len * n, 3 * hidden)
        flat_gh = d_gh[..., :3, :].transpose(0, 1).reshape(k, rows, 3 * hidden)
        flat_gi = flat_gh.clone()
        th.mul(d_states[1:], d_new, out=flat_gi.view(k, seq_len, n, 3 * hidden)[..., h2:].transpose(0, 1))
        d_x = th.bmm(flat_gi, w_ih) if ctx.needs_input_grad[0] else None
        h_prev_rows = h_prev.transpose(0, 1).reshape(k, rows, hidden)
        d_w_ih = th.bmm(flat_gi.transpose(1, 2), x)
        d_w_hh = th.bmm(flat_gh.transpose(1, 2), h_prev_rows)
        return d_x, d_steps[0], d_w_ih, d_w_hh, flat_gi.sum(1), flat_gh.sum(1)
