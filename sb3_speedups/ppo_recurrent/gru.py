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

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch as th
from torch import nn
from torch.autograd.function import once_differentiable

WEIGHT_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
SCRATCH_CAPACITY = 16  # shapes whose forward buffers are kept (a training run sees a handful of sequence counts)


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
        finals.append(out[:, -1])
        x = out.reshape(k, seq_len * n, -1)
    return [(out[i], th.stack([final[i] for final in finals])) for i in range(k)]


@dataclass(slots=True)
class GruScratch:
    """
    A forward's buffers for one shape, with every step's views made once (making them costs as much as the
    arithmetic); a later forward of that shape reuses them once the backward that reads them has run.

    :param gi: input projections ``(k, seq_len, n, 3 * hidden)``
    :param gates: per step, r and z and n's recurrent pre-activation ``(seq_len, k, n, 3 * hidden)``
    :param new: the candidate states n ``(seq_len, k, n, hidden)``
    :param steps: per step, the views ``gates_t, rz_t, r_t, z_t, gh_n_t, gi_n_t, new_t``
    :param token: the forward whose backward may read the buffers
    :param busy: whether that backward is still to come
    :param grads: the backward's gate slopes, then gradients ``(k, seq_len, n, 4, hidden)`` (made by its first use)
    :param d_states: the backward's state gradients ``(seq_len + 1, k, n, hidden)``
    :param back_steps: per step, the views ``grads_t, grad_rows_t, d_states[t], d_states[t + 1]`` (the last with an
        axis for the 4 slots)
    """

    gi: th.Tensor
    gates: th.Tensor
    new: th.Tensor
    steps: list[tuple[th.Tensor, ...]]
    token: object = field(default_factory=object)
    busy: bool = False
    grads: th.Tensor | None = None
    d_states: th.Tensor | None = None
    back_steps: list[tuple[th.Tensor, ...]] = field(default_factory=list)

    @th.inference_mode(False)
    def backward_buffers(self) -> tuple[th.Tensor, th.Tensor]:
        """:return: :attr:`grads` and :attr:`d_states`, made with :attr:`back_steps` on the first call"""
        if self.grads is None or self.d_states is None:
            k, seq_len, n, hidden = self.gi.shape[0], self.gi.shape[1], self.gi.shape[2], self.new.shape[-1]
            self.grads = self.gi.new_empty((k, seq_len, n, 4, hidden))
            self.d_states = self.gi.new_empty((seq_len + 1, k, n, hidden))
            views = (
                self.grads.unbind(1),
                self.grads.view(k, seq_len, n, 4 * hidden).unbind(1),
                self.d_states[:-1].unbind(0),
                self.d_states[1:].unsqueeze(3).unbind(0),
            )
            self.back_steps = list(zip(*views, strict=True))
        return self.grads, self.d_states

    @classmethod
    # normal tensors even when made under inference mode (acting), so that training can reuse them
    @th.inference_mode(False)
    def make(cls, k: int, seq_len: int, n: int, hidden: int, like: th.Tensor) -> GruScratch:
        """:return: fresh buffers for ``k`` layers of ``hidden`` units over ``seq_len`` steps of ``n`` sequences"""
        h2 = 2 * hidden
        gi = like.new_empty((k, seq_len, n, 3 * hidden))
        gates = like.new_empty((seq_len, k, n, 3 * hidden))
        new = like.new_empty((seq_len, k, n, hidden))
        views = (
            gates.unbind(0),
            gates[..., :h2].unbind(0),
            gates[..., :hidden].unbind(0),
            gates[..., hidden:h2].unbind(0),
            gates[..., h2:].unbind(0),
            gi[..., h2:].unbind(1),
            new.unbind(0),
        )
        return cls(gi, gates, new, list(zip(*views, strict=True)))

    def release(self, token: object) -> None:
        """Free the buffers for reuse if ``token``'s forward still owns them."""
        if token is self.token:
            self.busy = False


# one cache per thread: models training in two threads never share buffers
_scratch_local = threading.local()


def _take_scratch(k: int, seq_len: int, n: int, hidden: int, like: th.Tensor) -> GruScratch:
    """:return: the kept buffers of this shape when free, else fresh ones (kept when the shape is new)"""
    cache: dict[tuple[int, int, int, int], GruScratch] | None = getattr(_scratch_local, "cache", None)
    if cache is None:
        cache = _scratch_local.cache = {}
    key = (k, seq_len, n, hidden)
    kept = cache.get(key)
    if kept is not None and not kept.busy:
        scratch = kept
    else:
        scratch = GruScratch.make(k, seq_len, n, hidden, like)
        if kept is None:
            if len(cache) >= SCRATCH_CAPACITY:
                del cache[next(iter(cache))]
            cache[key] = scratch
    scratch.token, scratch.busy = object(), True
    return scratch


class GruLayer(th.autograd.Function):
    """
    ``k`` GRU layers of one shape in lockstep over ``seq_len`` steps of ``n`` sequences: inputs ``(k, seq_len * n,
    input)`` (step-major rows), initial states ``(k, n, hidden)``, weights stacked on a first axis of size ``k``;
    outputs ``(k, seq_len, n, hidden)``, with a hand-derived backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: th.Tensor, h0: th.Tensor, w_ih: th.Tensor, w_hh: th.Tensor, b_ih: th.Tensor, b_hh: th.Tensor
    ) -> th.Tensor:
        k, n, hidden = h0.shape
        seq_len, h2 = x.shape[1] // n, 2 * hidden
        scratch = _take_scratch(k, seq_len, n, hidden, x)
        gi, gates = scratch.gi, scratch.gates
        th.baddbmm(b_ih.unsqueeze(1), x, w_ih.transpose(1, 2), out=gi.view(k, seq_len * n, 3 * hidden))
        # Per step (contiguous for the recurrent product): what that product adds to (r, z: input part and both
        # biases; n: its recurrent bias), then, in place, r and z and n's recurrent pre-activation, kept for the backward.
        th.add(gi[..., :h2].transpose(0, 1), b_hh[:, None, :h2], out=gates[..., :h2])
        gates[..., h2:] = b_hh[:, None, h2:]
        # states[:, 0] = h0, states[:, t + 1] = the output of step t: the backward reads h_{t-1} as a view
        states = x.new_empty((k, seq_len + 1, n, hidden))
        states[:, 0] = h0
        w_hh_t, h = w_hh.transpose(1, 2).contiguous(), h0
        for (gates_t, rz_t, r_t, z_t, gh_n_t, gi_n_t, new_t), out_t in zip(
            scratch.steps, states[:, 1:].unbind(1), strict=True
        ):
            gates_t.baddbmm_(h, w_hh_t)
            rz_t.sigmoid_()
            th.addcmul(gi_n_t, gh_n_t, r_t, out=new_t).tanh_()
            h = th.lerp(new_t, h, z_t, out=out_t)  # (1 - z) * n + z * h
        ctx.save_for_backward(x, w_ih, w_hh, states)
        ctx.scratch, ctx.token = scratch, scratch.token
        if any(ctx.needs_input_grad):
            # released by the backward, or when the graph is dropped without one
            weakref.finalize(ctx, scratch.release, scratch.token)
        else:
            scratch.release(scratch.token)
        return states[:, 1:]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: th.Tensor) -> tuple[th.Tensor | None, ...]:  # type: ignore[override]
        x, w_ih, w_hh, states = ctx.saved_tensors
        k, seq_len, n, hidden = grad_out.shape
        h2, h3, rows = 2 * hidden, 3 * hidden, seq_len * n
        scratch = ctx.scratch
        if scratch.token is not ctx.token:
            raise RuntimeError(
                "the GRU layer's buffers were reused by a later forward before this backward ran again: "
                "run the forward again instead of back-propagating through its graph twice"
            )
        gates, new = scratch.gates, scratch.new
        rz, r, z, gh_n = gates[..., :h2], gates[..., :hidden], gates[..., hidden:h2], gates[..., h2:]
        h_prev = states[:, :-1]
        d_new = (1.0 - new * new).mul_(1.0 - z)
        # d(recurrent pre-activations r, z, n of step t) = d(out_t) * slope, and d(out_t)/d(h_{t-1}) outside the
        # recurrent product is z: [slope_r, slope_z, slope_n, z] times [W_hh; I] is one product per step.
        # grads[:, t] holds step t's slope until the loop multiplies it by d(out_t) in place.
        grads, d_states = scratch.backward_buffers()
        slope = grads.transpose(0, 1)  # the gates' step-major layout
        th.mul(d_new, gh_n, out=slope[..., 0, :])
        th.sub(h_prev.transpose(0, 1), new, out=slope[..., 1, :])
        slope[..., :2, :].mul_(th.addcmul(rz, rz, rz, value=-1.0).view(seq_len, k, n, 2, hidden))  # r(1-r), z(1-z)
        th.mul(d_new, r, out=slope[..., 2, :])
        slope[..., 3, :] = z
        eye = th.eye(hidden, dtype=w_hh.dtype, device=w_hh.device).expand(k, hidden, hidden)
        w_hh_eye = th.cat([w_hh, eye], dim=1)
        # d_states[t + 1]: d(loss)/d(out_t), through every later step once the loop has passed t; d_states[0]: d/d(h0)
        d_states[0] = 0.0
        d_states[1:] = grad_out.transpose(0, 1)
        for grads_t, rows_t, d_prev, d_out in reversed(scratch.back_steps):
            grads_t.mul_(d_out)
            d_prev.baddbmm_(rows_t, w_hh_eye)
        # slot 3 (d(out_t) * z) is spent: it becomes d(gi_n) = d(out_t) * d_new, so that the slots are
        # [d r, d z, d gh_n, d gi_n] and each weight gradient is one product over all steps
        th.mul(d_states[1:], d_new, out=slope[..., 3, :])
        flat = grads.view(k, rows, 4 * hidden)
        sums = flat.sum(1)
        # products with the strided slot columns on the right, where BLAS reads them in place
        d_w_hh = th.bmm(h_prev.reshape(k, rows, hidden).transpose(1, 2), flat[..., :h3]).transpose(1, 2)
        x_flat = th.bmm(x.transpose(1, 2), flat)
        d_w_ih = th.cat([x_flat[..., :h2], x_flat[..., h3:]], dim=2).transpose(1, 2)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_x = th.bmm(th.cat([flat[..., :h2], flat[..., h3:]], dim=2), w_ih)
        d_b_ih = th.cat([sums[:, :h2], sums[:, h3:]], dim=1)
        d_h0 = d_states[0].clone() if ctx.needs_input_grad[1] else None
        scratch.release(ctx.token)
        return d_x, d_h0, d_w_ih, d_w_hh, d_b_ih, sums[:, :h3]
