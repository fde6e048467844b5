"""
The output layer of a network as the matrix product the CPU's GEMM kernels run fastest.

An output a few units wide (a critic's value, a Pendulum actor's mean and log std, DQN's Q-values of CartPole's two
actions) is a product ``h @ W.T`` of a tall block with a matrix of a few columns, and MKL's kernels tile the result's
columns: with 2 to 8 of them most of each tile is wasted. The transposed product ``W @ h.T`` computes the same dot
products into a ``[width, rows]`` block, a shape the kernels tile well; the output is its transposed view (for one
column, the same memory as the ``[rows, 1]`` block). Measured on the 2-core AMD EPYC (docs/benchmarks.md, "Narrow
output layers"). A one-wide 2-D product is already a matrix-vector product, and wider outputs tile well, so both keep
the direct product.
"""

from __future__ import annotations

import torch as th

__all__ = ["NARROW_OUTPUT", "affine_into", "output_buffer", "transposes_output"]

#: outputs at most this wide run as the transposed product (12 and 16 wide are as fast or faster directly)
NARROW_OUTPUT = 8


def transposes_output(width: int, stacked: bool) -> bool:
    """
    :param width: the output layer's units
    :param stacked: a batched product of ``G`` stacked networks (``[G, rows, in]``), else a 2-D one
    :return: whether the layer runs as the transposed product
    """
    return width <= NARROW_OUTPUT and (stacked or width > 1)


@th.inference_mode(False)
def output_buffer(rows: int, width: int, groups: int | None, device: th.device) -> th.Tensor:
    """
    :param groups: the number of stacked networks, or ``None`` for one network's 2-D product
    :return: an empty output block ``[rows, width]`` (``[groups, rows, width]``) laid out as :func:`affine_into`
        writes it (a normal tensor, usable in any mode)
    """
    lead = () if groups is None else (groups,)
    if transposes_output(width, groups is not None):
        return th.empty(*lead, width, rows, device=device).transpose(-1, -2)
    return th.empty(*lead, rows, width, device=device)


def affine_into(out: th.Tensor, bias: th.Tensor, h: th.Tensor, weight: th.Tensor) -> th.Tensor:
    """
    :param out: the output block, from :func:`output_buffer`
    :param bias: the biases ``[width]`` (``[G, 1, width]``)
    :param h: the layer's input ``[rows, in]`` (``[G, rows, in]``)
    :param weight: the weights ``[width, in]`` (``[G, width, in]``), as the module holds them
    :return: ``out``, written with ``bias + h @ weight.T``
    """
    stacked = out.dim() == 3
    if transposes_output(out.shape[-1], stacked):
        if stacked:
            th.baddbmm(bias.mT, weight, h.mT, out=out.mT)
        else:
            th.addmm(bias.unsqueeze(1), weight, h.t(), out=out.t())
    elif stacked:
        th.baddbmm(bias, h, weight.mT, out=out)
    else:
        th.addmm(bias, h, weight.t(), out=out)
    return out
