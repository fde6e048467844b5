"""
Hot kernels rewritten for speed compute the same bits as the plain version they replace: the subnormal flush of the
flat optimizers' moments, and the quantile Huber loss with its buffers and views kept per call shape.
"""

from __future__ import annotations

import torch as th

from sb3_speedups.common.nn.optim import flush_subnormals_
from sb3_speedups.common.nn.quantile_huber import QuantileHuberLoss


def _masked_flush(tensor: th.Tensor) -> th.Tensor:
    """:return: ``tensor`` with the entries whose exponent bits are all zero set to +0.0 (the definition)"""
    bits = tensor.clone().view(th.int32)
    return bits.masked_fill_(bits.bitwise_and(0x7F800000).eq(0), 0).view(th.float32)


def test_flush_subnormals_equals_exponent_mask_on_every_kind_of_float() -> None:
    generator = th.Generator().manual_seed(0)
    edges = [0, 1, 0x007FFFFF, 0x00800000, 0x00800001, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF]
    edges += [b - 2**32 for b in (0x80000000, 0x80000001, 0x807FFFFF, 0x80800000, 0xFF800000, 0xFFC00000)]
    random_bits = th.randint(-(2**31), 2**31, (200_000,), generator=generator, dtype=th.int64)
    small_bits = th.randint(0, 0x01000000, (200_000,), generator=generator, dtype=th.int64)  # subnormal and tiny normal
    bits = th.cat([th.tensor(edges), random_bits, small_bits, small_bits - 2**31]).to(th.int32)
    tensor = bits.view(th.float32).clone()
    expected = _masked_flush(tensor)
    flush_subnormals_(tensor)
    # bit for bit (NaN payloads and the sign of zeros included): compare the integer views
    assert th.equal(tensor.view(th.int32), expected.view(th.int32))
    assert int((tensor.view(th.int32) != bits).sum()) > 0  # some entries were subnormal


def test_quantile_huber_kept_buffers_per_shape_give_a_fresh_objects_numbers() -> None:
    # one loss object serving calls of several shapes (QR-DQN's [b, Q] x [b, Q], TQC's [b, critics, Q] x [b, 1, T])
    # and both reductions in turn must give each call what a new object gives it: the same ops on the same shapes,
    # so bit for bit
    generator = th.Generator().manual_seed(1)
    shapes = [((64, 10), (64, 10)), ((32, 2, 10), (32, 1, 16)), ((64, 10), (64, 10)), ((8, 10), (8, 10))]
    kept = QuantileHuberLoss(10)
    for (current_shape, target_shape), sum_over_quantiles in zip(shapes * 3, [True, True, False] * 4, strict=True):
        current = th.randn(current_shape, generator=generator) * 2
        target = th.randn(target_shape, generator=generator) * 2
        grad, loss = kept(current, target, sum_over_quantiles)
        fresh_grad, fresh_loss = QuantileHuberLoss(10)(current, target, sum_over_quantiles)
        assert th.equal(grad, fresh_grad)
        assert th.equal(loss, fresh_loss)
