"""
Hand-derived forward and backward of an SB3 MLP actor-critic (``MlpExtractor`` + ``action_net`` + ``value_net``).

Without autograd the per-update cost is a few large matrix products plus a few dozen element-wise kernels, all
writing into preallocated buffers. When the policy and value networks have the same layer sizes (the default
``pi=[64, 64], vf=[64, 64]``) their layers run as one batched matrix product over the stacked pair: the flat
parameter layout puts each policy layer next to its value twin, so the stacked weights are plain views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.torch_layers import FlattenExtractor
from torch import nn

from sb3_speedups.common.nn.optim import FlatParameters

#: activations the hand-derived backward knows
ACTIVATIONS: dict[type[nn.Module], str] = {nn.Tanh: "tanh", nn.ReLU: "relu"}


def activation_(x: th.Tensor, kind: str) -> th.Tensor:
    """
    Apply the activation in place.

    :param x: pre-activations, overwritten with the activations
    :param kind: ``"tanh"`` or ``"relu"``
    :return: ``x``
    """
    if kind == "relu":
        return x.relu_()
    if x.device.type == "cpu" and x.is_contiguous():
        # torch's CPU tanh kernel is ~10x slower than numpy's vectorised one on these sizes (measured).
        array = x.numpy()
        np.tanh(array, out=array)
        return x
    return x.tanh_()


def affine_activation_(bias: th.Tensor, x: th.Tensor, weight_t: th.Tensor, out: th.Tensor, kind: str) -> th.Tensor:
    """
    ``out = activation(bias + x @ weight_t)`` for stacked ``[G, n, in]`` inputs.

    On the CPU, tanh runs as numpy's vectorised ``tanh`` in place (:func:`activation_`). Measured for the whole
    ``baddbmm`` + activation at ``[2, 256, 64]`` on a 2-core Xeon: 41-43 us, against 49-50 us for the former
    ``2 * sigmoid(2 z) - 1`` (two kernels) and 39-44 us for torch's tanh; on the 2-core EPYC machine torch's tanh
    took 120 us and its sigmoid 35 us. numpy's result is also the closer one to float64 tanh (6e-8 against 1.7e-7).

    :param bias: ``[G, 1, out]``
    :param x: ``[G, n, in]``
    :param weight_t: ``[G, in, out]``
    :param out: ``[G, n, out]``, overwritten
    :param kind: ``"tanh"`` or ``"relu"``
    :return: ``out``
    """
    return activation_(th.baddbmm(bias, x, weight_t, out=out), kind)


# The ops' C++ callables: calling them skips the Python frame of ``OpOverload.__call__`` (~1 us a call here).
_TANH_BACKWARD = getattr(th.ops.aten.tanh_backward.grad_input, "_op", th.ops.aten.tanh_backward.grad_input)
_THRESHOLD_BACKWARD = getattr(th.ops.aten.threshold_backward.grad_input, "_op", th.ops.aten.threshold_backward.grad_input)


def activation_backward_(grad: th.Tensor, y: th.Tensor, kind: str) -> th.Tensor:
    """
    Multiply ``grad`` in place by the activation's derivative, given its output ``y``.

    :return: ``grad``
    """
    if kind == "relu":
        return _THRESHOLD_BACKWARD(grad, y, 0.0, grad_input=grad)
    return _TANH_BACKWARD(grad, y, grad_input=grad)


def linear_layers(seq: nn.Module) -> tuple[list[nn.Linear], str | None] | None:
    """:return: the ``Linear`` layers of ``Linear, act, Linear, act, ...`` and the activation kind, or ``None``"""
    modules = list(seq.children()) if isinstance(seq, nn.Sequential) else None
    if modules is None or len(modules) % 2:
        return None
    linears = modules[0::2]
    acts = {type(m) for m in modules[1::2]}
    if not all(type(m) is nn.Linear for m in linears) or len(acts) > 1:
        return None
    kind = ACTIVATIONS.get(next(iter(acts))) if acts else None
    if acts and kind is None:
        return None
    return linears, kind  # type: ignore[return-value]


def mlp_unsupported_reason(policy: nn.Module) -> str | None:
    """
    :param policy: an SB3 policy
    :return: why :class:`ActorCriticMlp` cannot run it, or ``None`` when it can
    """
    if type(policy) is not ActorCriticPolicy:
        return f"policy class {type(policy).__name__} is not the plain MlpPolicy (ActorCriticPolicy)"
    if not isinstance(policy.features_extractor, FlattenExtractor) or not isinstance(
        policy.vf_features_extractor, FlattenExtractor
    ):
        return "features extractor is not FlattenExtractor"
    pi, vf = linear_layers(policy.mlp_extractor.policy_net), linear_layers(policy.mlp_extractor.value_net)
    if pi is None or vf is None:
        return "mlp_extractor is not Linear layers with a Tanh or ReLU activation"
    if pi[1] and vf[1] and pi[1] != vf[1]:
        return "policy and value networks use different activations"
    if type(policy.action_net) is not nn.Linear or type(policy.value_net) is not nn.Linear:
        return "action_net or value_net is not a Linear layer"
    if any(p.dtype != th.float32 for p in policy.parameters()):
        return "parameters are not float32"
    return None


def stackable(pi: Sequence[nn.Linear], vf: Sequence[nn.Linear]) -> bool:
    """:return: whether the policy and value layers have the same shapes (and can run as one batched product)"""
    return [lin.weight.shape for lin in pi] == [lin.weight.shape for lin in vf] and all(
        lin.bias is not None for lin in [*pi, *vf]
    )


def flat_layout(policy: ActorCriticPolicy) -> list[th.Tensor]:
    """
    :return: the policy's parameters in the order of the flat buffer: each policy layer's weight and bias next to its
        value twin's when the networks are :func:`stackable`, then the heads, then the rest (``log_std``)
    """
    pi = [m for m in policy.mlp_extractor.policy_net.modules() if isinstance(m, nn.Linear)]
    vf = [m for m in policy.mlp_extractor.value_net.modules() if isinstance(m, nn.Linear)]
    layout: list[th.Tensor] = []
    if stackable(pi, vf):
        for p_lin, v_lin in zip(pi, vf, strict=True):
            layout += [p_lin.weight, v_lin.weight, p_lin.bias, v_lin.bias]
    else:
        layout += [q for lin in [*pi, *vf] for q in lin.parameters()]
    layout += [q for net in (policy.action_net, policy.value_net) for q in net.parameters()]
    return layout + [p for p in policy.parameters() if all(p is not q for q in layout)]


def critic_parameters(policy: ActorCriticPolicy) -> list[th.Tensor]:
    """:return: the value network's parameters (``mlp_extractor.value_net`` and ``value_net``), input to output"""
    return [*policy.mlp_extractor.value_net.parameters(), *policy.value_net.parameters()]


def split_layout(policy: ActorCriticPolicy) -> list[th.Tensor]:
    """
    :return: the policy's parameters with every actor parameter (policy layers, action net, ``log_std``) before every
        critic parameter (:func:`critic_parameters`), so that each part is one contiguous range of the flat buffer
    """
    critic = critic_parameters(policy)
    return [p for p in policy.parameters() if all(p is not q for q in critic)] + critic


class MlpChain:
    """``G`` equally shaped MLPs (the pi/vf pair when stacked, else one) as ``[G, out, in]`` weight views."""

    def __init__(self, flat: FlatParameters, layers: list[list[nn.Linear]], kind: str | None) -> None:
        self.kind = kind or "tanh"
        self.groups = len(layers)
        depth = len(layers[0])
        self.weights = [flat.stacked([chain[k].weight for chain in layers]) for k in range(depth)]
        self.weights_t = [w.transpose(1, 2) for w in self.weights]
        self.biases = [flat.stacked([chain[k].bias for chain in layers]).unsqueeze(1) for k in range(depth)]
        self.grad_weights = [flat.stacked([chain[k].weight for chain in layers], grad=True) for k in range(depth)]
        self.grad_biases = [flat.stacked([chain[k].bias for chain in layers], grad=True) for k in range(depth)]
        self.grad_weights_t = [g.transpose(1, 2) for g in self.grad_weights]
        self.ws: dict[int, list[th.Tensor]] = {}
        self.ws_t: dict[int, list[th.Tensor]] = {}
        self.ws_numpy: dict[int, list[np.ndarray]] = {}
        self._input: tuple[th.Tensor, th.Tensor, th.Tensor] | None = None  # (x, x expanded, its transpose)

    @th.inference_mode(False)
    def _workspace(self, n: int, x: th.Tensor) -> list[th.Tensor]:
        # Allocated as normal tensors even when the update runs under inference mode, so they work in any mode.
        g = self.groups
        self.ws[n] = [th.empty(g, n, w.shape[1], device=x.device) for w in self.weights]  # activations
        self.ws[n] += [th.empty(g, n, w.shape[1], device=x.device) for w in self.weights]  # their gradients
        # Their transposes, made once: a view costs ~2 us, as much as some of the kernels here.
        self.ws_t[n] = [buffer.transpose(1, 2) for buffer in self.ws[n]]
        if self.kind == "tanh" and x.device.type == "cpu":  # numpy views of the activations, for the tanh
            self.ws_numpy[n] = [buffer.numpy() for buffer in self.ws[n][: len(self.weights)]]
        return self.ws[n]

    def forward(self, x: th.Tensor) -> th.Tensor:
        """:return: the last activations ``[G, n, out]`` (``x`` expanded when there are no layers)"""
        n = x.shape[0]
        if self._input is None or self._input[0] is not x:  # the same observations come back every epoch
            h = x.expand(self.groups, n, x.shape[1])
            self._input = (x, h, h.transpose(1, 2))
        h = self._input[1]
        if not self.weights:
            return h
        ws = self.ws.get(n) or self._workspace(n, x)
        self.x, self.x_t = h, self._input[2]
        arrays = self.ws_numpy.get(n)
        if arrays is None:
            for k, (w_t, b) in enumerate(zip(self.weights_t, self.biases, strict=True)):
                h = affine_activation_(b, h, w_t, ws[k], self.kind)
            return h
        for w_t, b, out, array in zip(self.weights_t, self.biases, ws, arrays, strict=False):
            h = th.baddbmm(b, h, w_t, out=out)
            np.tanh(array, out=array)  # activation_'s numpy tanh, on views made once
        return h

    def backward(self, d_last: th.Tensor) -> None:
        """Write the weight and bias gradients, given the gradient of the last activations (overwritten)."""
        depth = len(self.weights)
        n = d_last.shape[1]
        ws, ws_t = self.ws[n], self.ws_t[n]
        d = d_last
        d_t = ws_t[2 * depth - 1] if d_last is ws[2 * depth - 1] else d_last.transpose(1, 2)
        for k in range(depth - 1, -1, -1):
            activation_backward_(d, ws[k], self.kind)
            gw = self.grad_weights[k]
            if gw.shape[2] < gw.shape[1]:
                # [out, n] @ [n, in] with a narrow `in` is a poor GEMM shape; its transpose is not.
                below_t = ws_t[k - 1] if k > 0 else self.x_t
                self.grad_weights_t[k].copy_(th.bmm(below_t, d))
            else:
                th.bmm(d_t, ws[k - 1] if k > 0 else self.x, out=gw)
            th.sum(d, 1, out=self.grad_biases[k])
            if k > 0:
                d = th.bmm(d, self.weights[k], out=ws[depth + k - 1])
                d_t = ws_t[depth + k - 1]


class ActorCriticMlp:
    """
    Forward and backward of a supported ``ActorCriticPolicy`` (check :func:`mlp_unsupported_reason`) on views of
    one flat parameter buffer. Building it moves the policy's parameters into :attr:`flat`.

    :param policy: the policy; its parameters stay its own ``nn.Parameter`` objects
    :param split: run the actor and the critic as two separate parts (:meth:`forward_part`, :meth:`backward_part`)
        that two processes can compute side by side: nothing stacked, and the flat buffers (in shared memory) laid
        out as :func:`split_layout`, the critic from :attr:`critic_start` on
    """

    def __init__(self, policy: ActorCriticPolicy, split: bool = False) -> None:
        reason = mlp_unsupported_reason(policy)
        if reason is not None:
            raise ValueError(reason)
        pi, pi_kind = linear_layers(policy.mlp_extractor.policy_net)  # type: ignore[misc]
        vf, vf_kind = linear_layers(policy.mlp_extractor.value_net)  # type: ignore[misc]
        self.stacked = stackable(pi, vf) and not split
        layout = split_layout(policy) if split else flat_layout(policy)
        action_net, value_net = policy.action_net, policy.value_net
        assert isinstance(action_net, nn.Linear) and isinstance(value_net, nn.Linear)
        heads = [action_net.weight, action_net.bias, value_net.weight, value_net.bias]
        params = list(policy.parameters())
        critic = critic_parameters(policy)
        self.flat = FlatParameters(params, layout, shared=split, aligned=critic[0] if split else None)
        self.critic_start = self.flat.offset(critic[0]) if split else self.flat.data.numel()
        kind = pi_kind or vf_kind
        self.chains = (
            [MlpChain(self.flat, [pi, vf], kind)]
            if self.stacked
            else [MlpChain(self.flat, [pi], kind), MlpChain(self.flat, [vf], kind)]
        )
        self.action_weight, self.action_bias, self.value_weight, self.value_bias = (self.flat.data_of(p) for p in heads)
        self.grad_heads = [self.flat.grad_of(p) for p in heads]
        log_std = getattr(policy, "log_std", None)
        self.log_std = None if log_std is None else self.flat.data_of(log_std)
        self.grad_log_std = None if log_std is None else self.flat.grad_of(log_std)
        self.action_weight_t, self.value_weight_t = self.action_weight.t(), self.value_weight.t()
        self._out: dict[int, tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor]] = {}
        # Views of the latents (and numpy twins of them, of the outputs and of the heads' weights on the CPU), made
        # once per buffer: the heads' products run in numpy there, [256, 64] x [64, 2] in 3.5 us against torch's
        # addmm 7.4 us (measured here, as the value head's 2.1 against 4.9 us).
        self._latent_views: dict[int, tuple[Any, ...]] = {}
        self._d_last: dict[int, tuple[th.Tensor, th.Tensor, th.Tensor]] = {}
        self._transposed: tuple[th.Tensor, ...] | None = None  # (d_out, d_values, their transposes)
        self._numpy_heads = (
            (self.action_weight.numpy().T, self.action_bias.numpy(), self.value_weight.numpy().T, self.value_bias.numpy())
            if self.flat.data.device.type == "cpu"
            else None
        )
        self._parts: dict[tuple[int, int], tuple[Any, ...]] = {}  # per (part, n): its chain output, latent, arrays
        self._part_grads: dict[int, tuple[Any, ...]] = {}  # per part: (d, d.t(), d_last, d_last[0])

    def forward_part(self, x: th.Tensor, part: int) -> th.Tensor:
        """
        The forward of one part of a ``split`` network (the same operations as :meth:`forward` runs for it).

        :param x: flat float observations ``[n, obs_dim]``
        :param part: 0 for the actor, 1 for the critic
        :return: the action net's output ``[n, n_actions_out]`` (actor) or the values ``[n]`` (critic), reused buffers
        """
        n = x.shape[0]
        out, values, _, values_flat = self._out.get(n) or self._allocate_out(n, x.device)
        src = self.chains[part].forward(x)
        cached = self._parts.get((part, n))
        if cached is None or cached[0] is not src:
            latent = src[0]
            dst = out if part == 0 else values
            arrays = None
            if self._numpy_heads is not None and latent.is_contiguous():
                arrays = (latent.numpy(), dst.numpy())
            cached = self._parts[(part, n)] = (src, latent, arrays)
        latent, arrays = cached[1], cached[2]
        if part == 0:
            self.latent_pi = latent
        else:
            self.latent_vf = latent
        if arrays is not None and self._numpy_heads is not None:
            weight_t, bias = self._numpy_heads[2 * part], self._numpy_heads[2 * part + 1]
            np.add(np.matmul(arrays[0], weight_t, out=arrays[1]), bias, out=arrays[1])
        elif part == 0:
            th.addmm(self.action_bias, latent, self.action_weight_t, out=out)
        else:
            th.addmm(self.value_bias, latent, self.value_weight_t, out=values)
        return out if part == 0 else values_flat

    def backward_part(self, d: th.Tensor, part: int) -> None:
        """
        Write the gradients of one part of a ``split`` network (all but ``log_std``) into :attr:`flat` ``.grad``.

        :param d: gradient of the action net's output ``[n, n_out]`` (actor) or of the values ``[n, 1]`` (critic)
        :param part: 0 for the actor, 1 for the critic
        """
        g_w, g_b = self.grad_heads[2 * part], self.grad_heads[2 * part + 1]
        latent = self.latent_pi if part == 0 else self.latent_vf
        chain = self.chains[part]
        views = self._part_grads.get(part)
        if views is None or views[0] is not d:  # views made once per buffer (each costs a few us)
            d_last = chain.ws[d.shape[0]][2 * len(chain.weights) - 1] if chain.weights else None
            views = self._part_grads[part] = (d, d.t(), d_last, None if d_last is None else d_last[0])
        th.mm(views[1], latent, out=g_w)
        th.sum(d, 0, out=g_b)
        if views[2] is not None:
            th.mm(d, self.action_weight if part == 0 else self.value_weight, out=views[3])
            chain.backward(views[2])

    def _latents(self, x: th.Tensor, out: th.Tensor, values: th.Tensor) -> tuple[Any, ...]:
        """:return: ``(pi source, vf source, latent_pi, latent_vf, numpy views or None)``, cached per chain output"""
        if self.stacked:
            pi_src = vf_src = self.chains[0].forward(x)
        else:
            pi_src, vf_src = self.chains[0].forward(x), self.chains[1].forward(x)
        n = x.shape[0]
        views = self._latent_views.get(n)
        if views is None or views[0] is not pi_src or views[1] is not vf_src:
            latent_pi, latent_vf = (pi_src[0], pi_src[1]) if self.stacked else (pi_src[0], vf_src[0])
            arrays = None
            if self._numpy_heads is not None and latent_pi.is_contiguous() and latent_vf.is_contiguous():
                arrays = (latent_pi.numpy(), latent_vf.numpy(), out.numpy(), values.numpy())
            views = self._latent_views[n] = (pi_src, vf_src, latent_pi, latent_vf, arrays)
        return views

    def forward(self, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """
        :param x: flat float observations ``[n, obs_dim]``
        :return: the action net's output ``[n, n_actions_out]`` and the values ``[n]`` (reused buffers)
        """
        n = x.shape[0]
        out, values, _, values_flat = self._out.get(n) or self._allocate_out(n, x.device)
        _, _, self.latent_pi, self.latent_vf, arrays = self._latents(x, out, values)
        if arrays is not None and self._numpy_heads is not None:
            latent_pi, latent_vf, out_array, values_array = arrays
            action_w_t, action_b, value_w_t, value_b = self._numpy_heads
            np.add(np.matmul(latent_pi, action_w_t, out=out_array), action_b, out=out_array)
            np.add(np.matmul(latent_vf, value_w_t, out=values_array), value_b, out=values_array)
        else:
            th.addmm(self.action_bias, self.latent_pi, self.action_weight_t, out=out)
            th.addmm(self.value_bias, self.latent_vf, self.value_weight_t, out=values)
        return out, values_flat

    @th.inference_mode(False)
    def _allocate_out(self, n: int, device: th.device) -> tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor]:
        n_out = self.action_weight.shape[0]
        values = th.empty(n, 1, device=device)
        self._out[n] = (th.empty(n, n_out, device=device), values, th.empty(n, n_out, device=device), values.view(-1))
        return self._out[n]

    def d_out_buffer(self, n: int) -> th.Tensor:
        """:return: a buffer for the gradient of the action net's output (filled by the action head)"""
        return self._out[n][2]

    def backward(self, d_out: th.Tensor, d_values: th.Tensor) -> None:
        """
        Write the gradients of all parameters but ``log_std`` into :attr:`flat` ``.grad``.

        :param d_out: gradient of the action net's output ``[n, n_out]``
        :param d_values: gradient of the values ``[n, 1]``
        """
        g_wa, g_ba, g_wv, g_bv = self.grad_heads
        transposed = self._transposed
        if transposed is None or transposed[0] is not d_out or transposed[1] is not d_values:
            transposed = self._transposed = (d_out, d_values, d_out.t(), d_values.t())
        th.mm(transposed[2], self.latent_pi, out=g_wa)
        th.sum(d_out, 0, out=g_ba)
        th.mm(transposed[3], self.latent_vf, out=g_wv)
        th.sum(d_values, 0, out=g_bv)
        if self.stacked and self.chains[0].weights:
            chain = self.chains[0]
            n = d_out.shape[0]
            halves = self._d_last.get(n)
            if halves is None:
                d_last = chain.ws[n][2 * len(chain.weights) - 1]
                halves = self._d_last[n] = (d_last, d_last[0], d_last[1])
            th.mm(d_out, self.action_weight, out=halves[1])
            th.mm(d_values, self.value_weight, out=halves[2])
            chain.backward(halves[0])
        elif not self.stacked:
            for chain, d, w in ((self.chains[0], d_out, self.action_weight), (self.chains[1], d_values, self.value_weight)):
                if chain.weights:
                    d_last = chain.ws[d.shape[0]][2 * len(chain.weights) - 1]
                    th.mm(d, w, out=d_last[0])
                    chain.backward(d_last)

    @th.no_grad()
    def predict_values(self, x: th.Tensor) -> th.Tensor:
        """:return: values ``[n]`` of any number of observations (allocates; not for the per-minibatch path)"""
        chain, g = (self.chains[0], 1) if self.stacked else (self.chains[1], 0)
        h = x
        for w, b in zip(chain.weights, chain.biases, strict=True):
            h = activation_(th.addmm(b[g, 0], h, w[g].t()), chain.kind)
        return th.addmm(self.value_bias, h, self.value_weight.t()).view(-1)


class BufferedMlpForward:
    """
    ``mlp(x)`` for ``Linear`` layers with ReLU or Tanh between them (an SB3 ``QNetwork.q_net``), ``rows`` rows at a
    time, into buffers kept from call to call. Same operations as the module's own forward (``addmm``, then the
    activation in place), so the same values.

    Why not just call the module: its activations are fresh tensors of hundreds of KB on every call, and once
    glibc's dynamic mmap threshold has risen above their size they come from the heap, where small allocations that
    live longer (the environment's, the interpreter's) split the freed blocks. Measured here on DQN LunarLander
    (batch 128, 256x256, 4 gradient steps a call): the process grew by ~3 MB per 1,000 env steps, with the memory
    in use constant and only the heap's free space growing (to +300 MB in a 100k-step run).

    :param layers: the ``Linear`` layers, input to output
    :param kind: the activation between them, ``"relu"`` or ``"tanh"`` (``None``: a single layer)
    :param rows: rows per block (activations of thousands of rows spill out of the CPU caches)
    """

    def __init__(self, layers: Sequence[nn.Linear], kind: str | None, rows: int = 1024) -> None:
        if len(layers) > 1 and kind not in ("relu", "tanh"):
            raise ValueError(f"unsupported activation {kind!r}: choose 'relu' or 'tanh'")
        self.layers, self.kind, self.rows = list(layers), kind, rows
        self._hidden: dict[int, list[th.Tensor]] = {}
        self._out: dict[int, th.Tensor] = {}

    @classmethod
    def from_sequential(cls, seq: nn.Module, rows: int = 1024) -> BufferedMlpForward | None:
        """:return: the forward of ``Linear, act, ..., Linear`` (as ``QNetwork.q_net``), or ``None`` if not that"""
        modules = list(seq.children()) if isinstance(seq, nn.Sequential) else []
        if not modules or type(modules[-1]) is not nn.Linear:
            return None
        parsed = linear_layers(nn.Sequential(*modules[:-1]))
        if parsed is None or any(lin.bias is None for lin in [*parsed[0], modules[-1]]):
            return None
        return cls([*parsed[0], modules[-1]], parsed[1], rows)

    @th.inference_mode(False)
    def _buffers(self, n: int, block: int, like: th.Tensor) -> tuple[th.Tensor, list[th.Tensor]]:
        # Normal tensors even when called under inference mode, so that they can be written in any mode. Few distinct
        # sizes occur in a run (one per train() shape); the caches are emptied if that ever stops being true.
        if len(self._out) > 8:
            self._out.clear()
        if n not in self._out:
            self._out[n] = th.empty(n, self.layers[-1].out_features, dtype=like.dtype, device=like.device)
        if block not in self._hidden:
            if len(self._hidden) > 8:
                self._hidden.clear()
            self._hidden[block] = [
                th.empty(block, lin.out_features, dtype=like.dtype, device=like.device) for lin in self.layers[:-1]
            ]
        return self._out[n], self._hidden[block]

    @th.no_grad()
    def __call__(self, x: th.Tensor) -> th.Tensor:
        """
        :param x: inputs ``[n, in]``
        :return: outputs ``[n, out]``, in a buffer that the next call with ``n`` rows overwrites
        """
        n = x.shape[0]
        out, _ = self._buffers(n, min(n, self.rows), x)
        for start in range(0, n, self.rows):
            h = x[start : start + self.rows]
            hidden = self._buffers(n, h.shape[0], x)[1]
            for k, lin in enumerate(self.layers):
                last = k == len(self.layers) - 1
                dst = out[start : start + h.shape[0]] if last else hidden[k]
                th.addmm(lin.bias, h, lin.weight.t(), out=dst)
                if not last and self.kind == "relu":
                    dst.relu_()
                elif not last:
                    dst.tanh_()
                h = dst
        return out
