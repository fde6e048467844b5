"""
Optimizer steps over flat buffers (:class:`~sb3_speedups.common.nn.flat.FlatParameters`): one fused Adam call
(:class:`FlatAdam`), or RMSprop's few element-wise kernels on the whole buffer (:class:`FlatRMSprop`, A2C).

The ``torch.optim`` object stays the source of truth for the hyperparameters, and its state tensors are views into
the flat buffers, so ``optimizer.state_dict()`` holds exactly what the stock optimizer would hold.
:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep` is the step of an autograd loss on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch as th

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
