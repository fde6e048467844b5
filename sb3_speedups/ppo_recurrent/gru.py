"""
The training pass of a GRU over padded sequences, with its backward derived by hand.

torch's CPU ``nn.GRU`` runs each time step as separate gate operations that autograd records one by one, so its
backward replays hundreds of tiny kernels per sequence (its LSTM has one fused kernel). Here a layer's forward is one
input projection for all steps, then per step one in-place recurrent product and four in-place gate operations; the
backward derives every gate slope for all steps at once from the kept gates, runs the time loop with one product and
one multiply per step, and computes each weight gradient as one product over all steps. With ``r, z`` the reset and
update gates, ``n = tanh(gi_n + r * gh_n)`` and ``h_t = (1 - z) * n + z * h_{t-1}``:
``dh_{t-1} = z * dh_t + [dh_t * slope] @ W_hh`` with ``slope = [(1 - z)(1 - n^2) gh_n r(1 - r), (h_{t-1} - n) z(1 - z),
(1 - z)(1 - n^2) r]``. Results equal ``nn.GRU``'s up to float rounding; the parameters stay the module's, so saved
models are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch as th
from torch import nn
from torch.autograd.function import once_differentiable


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
    if gru_unsupported_reason(rnn, sequence) is not None:
        return rnn(sequence, h0)
    out, finals = sequence, []
    for layer in range(rnn.num_layers):
        weights = [getattr(rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        out = GruLayer.apply(out, h0[layer], *weights)
        finals.append(out[-1])
    return out, th.stack(finals)


class GruLayer(th.autograd.Function):
    """One GRU layer over ``(seq_len, n, input)`` from ``h0`` ``(n, hidden)``: the outputs, with a hand-derived backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: th.Tensor, h0: th.Tensor, w_ih: th.Tensor, w_hh: th.Tensor, b_ih: th.Tensor, b_hh: th.Tensor
    ) -> th.Tensor:
        seq_len, n, _ = x.shape
        hidden = w_hh.shape[1]
        h2 = 2 * hidden
        gi = th.addmm(b_ih, x.reshape(seq_len * n, -1), w_ih.t()).view(seq_len, n, 3 * hidden)
        # Per step: what the recurrent product adds to (r, z: input part and both biases; n: its recurrent bias),
        # then, in place, r and z and n's recurrent pre-activation, kept for the backward.
        gates = th.cat([gi[..., :h2] + b_hh[:h2], b_hh[h2:].expand(seq_len, n, hidden)], dim=2)
        new = x.new_empty((seq_len, n, hidden))
        out = x.new_empty((seq_len, n, hidden))
        w_hh_t, h = w_hh.t().contiguous(), h0
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
            gates_t.addmm_(h, w_hh_t)
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
        seq_len, n, hidden = out.shape
        h2, rows = 2 * hidden, seq_len * n
        gates = ctx.gates.view(rows, 3 * hidden)
        r, z, gh_n, new = gates[:, :hidden], gates[:, hidden:h2], gates[:, h2:], ctx.new.view(rows, hidden)
        h_prev = th.cat([h0.unsqueeze(0), out[:-1]]).view(rows, hidden)
        d_new = (1.0 - z).mul_(1.0 - new * new)
        # d(recurrent pre-activations r, z, n of step t) = d(out_t) * slope, and d(out_t)/d(h_{t-1}) outside the
        # recurrent product is z: [slope_r, slope_z, slope_n, z] times [W_hh; I] is one product per step.
        slope = gates.new_empty((rows, 4, hidden))
        th.mul(d_new, gh_n, out=slope[:, 0]).mul_(r).mul_(1.0 - r)
        th.sub(h_prev, new, out=slope[:, 1]).mul_(z).mul_(1.0 - z)
        th.mul(d_new, r, out=slope[:, 2])
        slope[:, 3] = z
        w_hh_eye = th.cat([w_hh, th.eye(hidden, dtype=w_hh.dtype, device=w_hh.device)])
        d_gh = th.empty_like(slope)
        # d_states[t + 1]: d(loss)/d(out_t), through every later step once the loop has passed t; d_states[0]: d/d(h0)
        d_states = th.cat([grad_out.new_zeros((1, n, hidden)), grad_out])
        d_steps, d_steps_4 = d_states.unbind(0), d_states.unsqueeze(2).unbind(0)
        steps = zip(
            slope.view(seq_len, n, 4, hidden).unbind(0),
            d_gh.view(seq_len, n, 4, hidden).unbind(0),
            d_gh.view(seq_len, n, 4 * hidden).unbind(0),
            strict=True,
        )
        for t, (slope_t, d_gh_t, d_gh_rows) in reversed(list(enumerate(steps))):
            th.mul(d_steps_4[t + 1], slope_t, out=d_gh_t)
            d_steps[t].addmm_(d_gh_rows, w_hh_eye)
        flat_gh = d_gh[:, :3].reshape(rows, 3 * hidden)
        flat_gi = flat_gh.clone()
        th.mul(d_states[1:].view(rows, hidden), d_new, out=flat_gi[:, h2:])
        flat_x = x.reshape(rows, -1)
        d_x = (flat_gi @ w_ih).view(x.shape) if ctx.needs_input_grad[0] else None
        return d_x, d_steps[0], flat_gi.t() @ flat_x, flat_gh.t() @ h_prev, flat_gi.sum(0), flat_gh.sum(0)
