"""
Optimizer steps over flat buffers (:class:`~sb3_speedups.common.nn.flat.FlatParameters`): one fused Adam call
(:class:`FlatAdam`), or RMSprop's few element-wise kernels on the whole buffer (:class:`FlatRMSprop`, A2C).

The ``torch.optim`` object stays the source of truth for the hyperparameters, and its state tensors are views into
the flat buffers, so ``optimizer.state_dict()`` holds exactly what the stock optimizer would hold.
:class:`FlatOptimizerStep` is the step of an autograd loss on them (PPO's and A2C's autograd updates, RecurrentPPO).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch as th
from torch import nn

from sb3_speedups.common.nn.flat import FlatParameters, shared_zeros
from sb3_speedups.common.torch_utils import KeptScalar

#: Adam steps between two flushes of subnormal moments (:meth:`FlatAdam.flush_subnormal_moments`)
FLUSH_SUBNORMALS_EVERY = 16
#: the flush only runs with an Adam ``eps`` at least this large (torch's default 1e-8, SB3's PPO 1e-5), where a
#: subnormal moment cannot change a parameter (see :meth:`FlatAdam.flush_subnormal_moments`)
FLUSH_MIN_EPS = 1e-10
# the largest subnormal float32 (all exponent bits zero, all fraction bits one)
_LARGEST_SUBNORMAL = float(th.tensor(0x007FFFFF, dtype=th.int32).view(th.float32))


def _flat_unsupported_reason(
    optimizer: th.optim.Optimizer, params: Sequence[th.Tensor], kind: type, options: tuple[tuple[str, object], ...]
) -> str | None:
    """:return: why a flat optimizer of torch's ``kind`` cannot run ``optimizer`` (``options``: the values it needs)"""
    if type(optimizer) is not kind:
        return f"optimizer is {type(optimizer).__name__}, not torch.optim.{kind.__name__}"
    if len(optimizer.param_groups) != 1:
        return "optimizer has several parameter groups"
    group = optimizer.param_groups[0]
    if [id(p) for p in group["params"]] != [id(p) for p in params]:
        return "optimizer does not hold exactly the policy's parameters"
    for key, fine in options:
        if group.get(key, fine) != fine:
            return f"optimizer uses {key}={group[key]}"
    steps = {float(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state.get(p, {})}
    if len(steps) > 1 or (steps and len([p for p in params if "step" in optimizer.state.get(p, {})]) != len(params)):
        return "optimizer state has different step counts per parameter"
    return None


def adam_unsupported_reason(optimizer: th.optim.Optimizer, params: Sequence[th.Tensor]) -> str | None:
    """
    :param optimizer: the policy's optimizer
    :param params: the parameters it should hold, in order
    :return: why :class:`FlatAdam` cannot run it, or ``None`` when it can
    """
    options = (("amsgrad", False), ("maximize", False), ("differentiable", False), ("weight_decay", 0))
    return _flat_unsupported_reason(optimizer, params, th.optim.Adam, options)


def rmsprop_unsupported_reason(optimizer: th.optim.Optimizer, params: Sequence[th.Tensor]) -> str | None:
    """
    :param optimizer: the policy's optimizer
    :param params: the parameters it should hold, in order
    :return: why :class:`FlatRMSprop` cannot run it, or ``None`` when it can
    """
    options = (
        ("momentum", 0),
        ("centered", False),
        ("maximize", False),
        ("differentiable", False),
        ("capturable", False),
        ("weight_decay", 0),
    )
    return _flat_unsupported_reason(optimizer, params, th.optim.RMSprop, options)


def flat_optimizer_unsupported_reason(optimizer: th.optim.Optimizer, params: Sequence[th.Tensor]) -> str | None:
    """:return: why neither :class:`FlatAdam` nor :class:`FlatRMSprop` can run ``optimizer``, or ``None``"""
    if type(optimizer) is th.optim.RMSprop:
        return rmsprop_unsupported_reason(optimizer, params)
    reason = adam_unsupported_reason(optimizer, params)
    if reason is not None and reason.startswith("optimizer is "):
        return f"optimizer is {type(optimizer).__name__}, not torch.optim.Adam or torch.optim.RMSprop"
    return reason


def make_flat_optimizer(flat: FlatParameters, optimizer: th.optim.Optimizer) -> FlatAdam | FlatRMSprop:
    """:return: the flat twin of ``optimizer`` (check :func:`flat_optimizer_unsupported_reason` first)"""
    return FlatRMSprop(flat, optimizer) if type(optimizer) is th.optim.RMSprop else FlatAdam(flat, optimizer)


def flush_subnormals_(tensor: th.Tensor) -> None:
    """Set the subnormal entries (below 1.2e-38 in size) of a float32 tensor to zero, in place."""
    # hardshrink zeroes |x| <= lambd (-0.0 too, to +0.0) and keeps the rest, NaN included, in one vectorised pass:
    # the result of masking the entries whose exponent bits are all zero, several times faster
    th.hardshrink(tensor, _LARGEST_SUBNORMAL, out=tensor)


class FlatAdam:
    """
    Adam on :class:`FlatParameters` in one fused step, sharing hyperparameters and state with a ``torch.optim.Adam``.

    Existing optimizer state (a loaded model) is copied in; afterwards ``optimizer.state[p]`` holds views into the
    flat moment buffers (and one step counter per parameter, as stock Adam does), so saving and loading the
    optimizer's ``state_dict`` works with stock SB3. Check :func:`adam_unsupported_reason` first.

    :param flat: the flat parameters
    :param optimizer: the ``torch.optim.Adam`` over exactly ``flat.params``
    """

    def __init__(self, flat: FlatParameters, optimizer: th.optim.Optimizer) -> None:
        reason = adam_unsupported_reason(optimizer, flat.params)
        if reason is not None:
            raise ValueError(reason)
        self.flat, self.optimizer = flat, optimizer
        if flat.shared:
            self.exp_avg, self.exp_avg_sq = (shared_zeros(flat.data.numel(), flat.data.dtype) for _ in range(2))
        else:
            self.exp_avg = th.zeros_like(flat.data)
            self.exp_avg_sq = th.zeros_like(flat.data)
        # Fused kernels want float32 step counters on the parameters' device.
        self.steps = th.zeros(len(flat.params), dtype=th.float32, device=flat.data.device)
        with th.no_grad():
            for i, p in enumerate(flat.params):
                old = optimizer.state.get(p, {})
                m = flat.view_of(self.exp_avg, p)
                v = flat.view_of(self.exp_avg_sq, p)
                if "exp_avg" in old:
                    m.copy_(old["exp_avg"])
                    v.copy_(old["exp_avg_sq"])
                    self.steps[i] = float(old["step"])
                optimizer.state[p] = {"step": self.steps[i], "exp_avg": m, "exp_avg_sq": v}
        self._bound = [optimizer.state[p]["exp_avg"] for p in flat.params]
        # per parameter, for a step with gradients outside the flat buffer: data views, moment views, step counters
        self._per_param = (
            [flat.data_of(p) for p in flat.params],
            self._bound,
            [optimizer.state[p]["exp_avg_sq"] for p in flat.params],
            [self.steps[i] for i in range(len(flat.params))],
        )
        self._first_step = self.steps[0]  # the fused kernel reads one counter (all are equal); a view made once
        self._one = KeptScalar(self.steps.device)(1.0)
        self._steps_since_flush = 0
        self._ranges: dict[tuple[int, int] | None, list[th.Tensor]] = {}
        # only CPUs slow down on subnormal numbers (and a recorded CUDA graph must not depend on a host counter)
        self._on_cpu = flat.data.device.type == "cpu"

    def is_bound(self) -> bool:
        """:return: whether the optimizer still holds our state views (``optimizer.load_state_dict`` replaces them)"""
        state = self.optimizer.state
        return all(state.get(p, {}).get("exp_avg") is view for p, view in zip(self.flat.params, self._bound, strict=True))

    def hyperparameters(self) -> tuple[float, float, float, float]:
        """:return: ``(lr, beta1, beta2, eps)`` as the optimizer holds them now"""
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        return float(group["lr"]), float(beta1), float(beta2), float(group["eps"])

    def step(
        self, grad_divisor: th.Tensor | None = None, lr: th.Tensor | None = None, grads: Sequence[th.Tensor] | None = None
    ) -> None:
        """
        One Adam step of every parameter with the flat gradient, reading ``lr``/``betas``/``eps`` from the optimizer.
        (The flat buffers are plain tensors, so no ``no_grad`` context is needed.)

        :param grad_divisor: divide the gradient by this first, inside the fused kernel (gradient clipping)
        :param lr: a 0-dim tensor on the parameters' device to read the learning rate from instead (CUDA graphs)
        :param grads: one gradient per parameter, in ``flat.params`` order and laid out as its parameter (as autograd
            stores them), to step with instead of the flat gradient buffer (the same element-wise kernel, run per
            parameter: it pairs entries by their place in memory)
        """
        self.steps.add_(self._one)
        host_lr, beta1, beta2, eps = self.hyperparameters()
        self._fused_step(None, grad_divisor, host_lr if lr is None else lr, beta1, beta2, eps, grads)

    def step_range(
        self, part: slice, grad_divisor: th.Tensor | None, lr: float, beta1: float, beta2: float, eps: float, step: float
    ) -> None:
        """
        The Adam step of :meth:`step` on one contiguous range of the flat buffers only (element-wise, so the same
        numbers as the whole step gives there). Two processes that share the buffers each step their own range.

        :param part: the range of the flat buffers
        :param grad_divisor: as in :meth:`step`
        :param lr: learning rate
        :param beta1: Adam's beta1
        :param beta2: Adam's beta2
        :param eps: Adam's eps
        :param step: the step count after this step (every parameter's counter is set to it)
        """
        self.steps.fill_(step)
        self._fused_step(part, grad_divisor, lr, beta1, beta2, eps)

    def _fused_step(
        self,
        part: slice | None,
        grad_divisor: th.Tensor | None,
        lr: float | th.Tensor,
        beta1: float,
        beta2: float,
        eps: float,
        grads: Sequence[th.Tensor] | None = None,
    ) -> None:
        if grads is None:
            key = None if part is None else (part.start, part.stop)
            tensors = self._ranges.get(key)
            if tensors is None:  # views made once per range
                whole = [self.flat.data, self.flat.grad, self.exp_avg, self.exp_avg_sq]
                tensors = self._ranges[key] = whole if part is None else [t[part] for t in whole]
            params, grad_list, exp_avgs, exp_avg_sqs = [tensors[0]], [tensors[1]], [tensors[2]], [tensors[3]]
            steps = [self._first_step]
        else:
            params, exp_avgs, exp_avg_sqs, steps = self._per_param
            grad_list = list(grads)
        th._fused_adam_(
            params,
            grad_list,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=0.0,
            eps=eps,
            maximize=False,
            grad_scale=grad_divisor,
        )
        self._steps_since_flush += 1
        if self._steps_since_flush >= FLUSH_SUBNORMALS_EVERY and self._on_cpu and eps >= FLUSH_MIN_EPS:
            self.flush_subnormal_moments(part)

    def flush_subnormal_moments(self, part: slice | None = None) -> None:
        """
        Set the moments' subnormal entries (below 1.2e-38 in size) to zero.

        A unit that stops receiving gradient (a dead ReLU) has its first moment decay by ``beta1`` each step into the
        subnormal range, where the CPU's arithmetic is many times slower. Flushed, such an entry is exactly zero and
        stays so. The parameters do not change: the step of an entry is ``lr * m_hat / (sqrt(v_hat) + eps)``; with
        ``eps >= 1e-10`` (:data:`FLUSH_MIN_EPS`) a subnormal ``m`` moves a parameter by less than 1e-27, and a
        subnormal ``v`` (square root below 1.1e-19) changes the denominator by less than float32's rounding.

        :param part: flush only this range of the flat buffers (default: all)
        """
        self._steps_since_flush = 0
        for moment in (self.exp_avg, self.exp_avg_sq):
            flush_subnormals_(moment if part is None else moment[part])


class FlatRMSprop:
    """
    ``torch.optim.RMSprop`` (no momentum, not centred) on :class:`FlatParameters`, sharing hyperparameters and state
    with the optimizer object as :class:`FlatAdam` does (``optimizer.state[p]`` holds views of the flat
    ``square_avg``). Torch has no fused RMSprop kernel; on one flat tensor its update is four element-wise kernels,
    the operations of torch's own loop (``_single_tensor_rmsprop``). See docs/maths.md, "A2C loss".

    :param flat: the flat parameters
    :param optimizer: the ``torch.optim.RMSprop`` over exactly ``flat.params`` (check
        :func:`rmsprop_unsupported_reason`)
    """

    def __init__(self, flat: FlatParameters, optimizer: th.optim.Optimizer) -> None:
        reason = rmsprop_unsupported_reason(optimizer, flat.params)
        if reason is not None:
            raise ValueError(reason)
        self.flat, self.optimizer = flat, optimizer
        self.square_avg = shared_zeros(flat.data.numel(), flat.data.dtype) if flat.shared else th.zeros_like(flat.data)
        self._avg = th.empty_like(flat.data)
        self.steps = th.zeros(len(flat.params), dtype=th.float32)  # torch keeps RMSprop's counters on the CPU
        with th.no_grad():
            for i, p in enumerate(flat.params):
                old = optimizer.state.get(p, {})
                view = flat.view_of(self.square_avg, p)
                if "square_avg" in old:
                    view.copy_(old["square_avg"])
                    self.steps[i] = float(old["step"])
                optimizer.state[p] = {"step": self.steps[i], "square_avg": view}
        self._bound = [optimizer.state[p]["square_avg"] for p in flat.params]
        self._steps_since_flush = 0
        self._on_cpu = flat.data.device.type == "cpu"
        device, dtype = flat.data.device, flat.data.dtype
        self._alpha, self._eps = KeptScalar(device, dtype), KeptScalar(device, dtype)
        self._one = KeptScalar(self.steps.device)(1.0)

    def is_bound(self) -> bool:
        """:return: whether the optimizer still holds our state views (``optimizer.load_state_dict`` replaces them)"""
        state = self.optimizer.state
        return all(state.get(p, {}).get("square_avg") is v for p, v in zip(self.flat.params, self._bound, strict=True))

    def step(self, grad_divisor: th.Tensor | None = None) -> None:
        """
        One RMSprop step of every parameter with the flat gradient, reading ``lr``/``alpha``/``eps`` from the optimizer.

        :param grad_divisor: divide the gradient by this first (gradient clipping, :meth:`FlatParameters.clip_divisor`)
        """
        group = self.optimizer.param_groups[0]
        lr, alpha, eps = float(group["lr"]), float(group["alpha"]), float(group["eps"])
        grad = self.flat.grad
        if grad_divisor is not None:
            grad.div_(grad_divisor)
        self.steps.add_(self._one)
        self.square_avg.mul_(self._alpha(alpha)).addcmul_(grad, grad, value=1 - alpha)
        th.sqrt(self.square_avg, out=self._avg).add_(self._eps(eps))
        self.flat.data.addcdiv_(grad, self._avg, value=-lr)
        self._steps_since_flush += 1
        # as FlatAdam's second moment: a subnormal square_avg moves no parameter while eps >= FLUSH_MIN_EPS
        if self._steps_since_flush >= FLUSH_SUBNORMALS_EVERY and self._on_cpu and eps >= FLUSH_MIN_EPS:
            self._steps_since_flush = 0
            flush_subnormals_(self.square_avg)


class FlatOptimizerStep:
    """
    ``zero_grad`` / ``backward`` / ``clip_grad_norm_`` / ``optimizer.step`` for an autograd loss, with one flat
    gradient buffer and one fused Adam step when the optimizer is a plain ``torch.optim.Adam`` (otherwise the stock
    calls). Autograd accumulates straight into the flat gradient buffer (``param.grad`` are views of it), or with
    ``take_grads`` stores fresh gradient tensors that Adam steps with.

    :param module: the module whose parameters the optimizer holds
    :param optimizer: its optimizer (its ``param_groups`` stay the source of the learning rate)
    :param rmsprop: also run a plain ``torch.optim.RMSprop`` flat (:class:`FlatRMSprop`); off, it takes the stock
        calls, whose numbers differ from the flat step's in the last bits
    :param flat: ``False`` always takes the stock calls (where another flat buffer holds some of the parameters)
    :param take_grads: with a flat Adam, let autograd store each gradient as it computes it (``param.grad`` set to
        ``None`` before ``backward``, as ``zero_grad`` does) and step Adam over those tensors, instead of zeroing the
        flat gradient buffer and adding every gradient into it: two passes fewer over the gradient, which pays for
        networks with large layers (a CNN's first fully connected layer). The clipping norm is then stock's per-tensor
        norm of norms.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: th.optim.Optimizer,
        rmsprop: bool = False,
        *,
        flat: bool = True,
        take_grads: bool = False,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        params = list(module.parameters())
        self.flat: FlatParameters | None = None
        self.flat_optimizer: FlatAdam | FlatRMSprop | None = None
        self.take_grads = False
        unsupported = flat_optimizer_unsupported_reason if rmsprop else adam_unsupported_reason
        if flat and unsupported(optimizer, params) is None:
            self.flat = FlatParameters(params)
            self.flat_optimizer = make_flat_optimizer(self.flat, optimizer)
            self.take_grads = take_grads and isinstance(self.flat_optimizer, FlatAdam)
            if not self.take_grads:
                self._attach()

    @property
    def adam(self) -> FlatAdam | None:
        """:return: the flat Adam, where the optimizer is one"""
        return self.flat_optimizer if isinstance(self.flat_optimizer, FlatAdam) else None

    def _attach(self) -> None:
        assert self.flat is not None
        self.flat.attach_grads()
        self._views = [p.grad for p in self.flat.params]

    def is_bound(self, optimizer: th.optim.Optimizer) -> bool:
        """:return: whether ``optimizer`` is still ours and the parameters and its state still live in our buffers"""
        if optimizer is not self.optimizer:
            return False
        flat_optimizer = self.flat_optimizer
        return self.flat is None or (self.flat.is_bound() and flat_optimizer is not None and flat_optimizer.is_bound())

    def backward(self, loss: th.Tensor) -> None:
        """Back-propagate ``loss`` into zeroed gradients."""
        if self.flat is None:
            self.optimizer.zero_grad()
            loss.backward()
            return
        if self.take_grads:
            for p in self.flat.params:
                p.grad = None
            loss.backward()
            return
        self.flat.grad.zero_()
        loss.backward()
        if any(p.grad is not g for p, g in zip(self.flat.params, self._views, strict=True)):
            # the gradients were set to None or replaced (``optimizer.zero_grad()``): take them over and re-attach
            for p in self.flat.params:
                if p.grad is not None:
                    self.flat.grad_of(p).copy_(p.grad)
            self._attach()

    def step(self, max_grad_norm: float | None = None) -> None:
        """Clip the gradient's norm to ``max_grad_norm`` (``None``: no clipping) and take one optimizer step."""
        if self.flat is None or self.flat_optimizer is None:
            if max_grad_norm is not None:
                th.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
            self.optimizer.step()
            return
        if self.take_grads:
            assert isinstance(self.flat_optimizer, FlatAdam)
            # a parameter the loss does not reach steps with a zero gradient, as on the flat buffer
            grads = [th.zeros_like(p) if p.grad is None else p.grad for p in self.flat.params]
            divisor = None
            if max_grad_norm is not None:
                norm = th.linalg.vector_norm(th.stack(th._foreach_norm(grads)))
                divisor = self.flat.clip_divisor(max_grad_norm, norm)
            self.flat_optimizer.step(divisor, grads=grads)
            return
        self.flat_optimizer.step(None if max_grad_norm is None else self.flat.clip_divisor(max_grad_norm))
