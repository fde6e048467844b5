"""
:class:`ParameterMirror`: plain-tensor copies of a module's parameters (and buffers) on the acting device (CPU), for
the frozen actors to run on; refreshed with one copy when the source tensors share one flat buffer
(:class:`sb3_speedups.common.nn.flat.FlatParameters`), each copy at its source's alignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch as th


@dataclass
class _Tiled:
    """The sources' addresses when they were last found to tile one storage, and the flat view over them."""

    pointers: list[int]
    flat: th.Tensor


class ParameterMirror:
    """
    Copies of ``sources`` on ``device``, kept in one flat tensor; :meth:`sync` refreshes them.

    :param sources: tensors or parameters to mirror (read afresh at each :meth:`sync`, so a parameter whose
        storage moved is still followed)
    :param device: where the copies live
    :param keep_order: lay the copies out packed in the order given (so that neighbours can be viewed as one stacked
        tensor), instead of in the sources' storage order, each at its source's alignment
    """

    def __init__(self, sources: Sequence[th.Tensor], device: th.device | str = "cpu", keep_order: bool = False) -> None:
        self.sources = list(sources)
        self.device = th.device(device)
        detached = [s.detach() for s in self.sources]
        # In source-storage order, sources that tile one flat buffer are refreshed with one copy.
        self._order = list(range(len(detached)))
        if not keep_order:
            self._order.sort(key=lambda i: (detached[i].untyped_storage().data_ptr(), detached[i].storage_offset()))
        dtype = detached[0].dtype if detached else th.float32
        # Each copy starts at its source's address modulo 64 bytes (zeros pad the gaps): CPU matrix kernels round
        # differently by their operands' alignment (seen: a 1-row weight's product, by its address modulo 16 bytes),
        # and acting is to give the module's numbers. Sources that tile one buffer stay one run of copies. Copies
        # kept in order are packed (neighbours are viewed as one stacked tensor).
        item = th.empty((), dtype=dtype).element_size()
        align = 1 if keep_order else max(1, 64 // item)
        starts, offset = {}, 0
        for i in self._order:
            offset += (detached[i].data_ptr() // item - offset) % align
            starts[i] = offset
            offset += detached[i].numel()
        self.flat = th.zeros(offset + align, dtype=dtype, device=self.device)
        shift = (-(self.flat.data_ptr() // item)) % align  # where the buffer's first 64-byte boundary is
        self._tiled: _Tiled | None = None
        #: the sources' addresses when they did not tile one buffer
        self._untiled: list[int] | None = None
        self.copies: list[th.Tensor] = [self.flat] * len(detached)
        for i in self._order:
            start = shift + starts[i]
            self.copies[i] = self.flat[start : start + detached[i].numel()].view_as(detached[i])
        #: the copies from the first to the last (one run when the sources tile one buffer)
        self.run = self.flat[shift + starts[self._order[0]] : shift + offset] if detached else self.flat[:0]
        self.sync()

    def _tiling(self, sources: list[th.Tensor]) -> th.Tensor | None:
        """:return: one flat view over ``sources`` when, in mirror order, they tile one storage contiguously"""
        first = sources[self._order[0]]
        storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
        offset = start
        for i in self._order:
            s = sources[i]
            if s.untyped_storage().data_ptr() != storage or s.storage_offset() != offset or not s.is_contiguous():
                return None
            if s.dtype != self.flat.dtype:
                return None
            offset += s.numel()
        return th.as_strided(first, (offset - start,), (1,), start)

    def sync(self) -> None:
        """Copy the sources' current values (one transfer when they tile one flat buffer)."""
        tiled = self._tiled
        # The sources still where the tiling was found: the view keeps that storage alive, so equal addresses can
        # only be the same tensors (a moved or replaced parameter has a new address).
        if tiled is not None and list(map(th.Tensor.data_ptr, self.sources)) == tiled.pointers:
            self.run.copy_(tiled.flat)
            return
        if self._untiled is not None and list(map(th.Tensor.data_ptr, self.sources)) == self._untiled:
            self._copy_each([s.detach() for s in self.sources])  # still where no tiling was found
            return
        self._sync_and_find_tiling()

    @th.no_grad()
    def _sync_and_find_tiling(self) -> None:
        if not self.sources:
            return
        sources = [s.detach() for s in self.sources]
        flat = self._tiling(sources)
        self._tiled = None if flat is None else _Tiled(list(map(th.Tensor.data_ptr, sources)), flat)
        self._untiled = list(map(th.Tensor.data_ptr, sources)) if flat is None else None
        if flat is not None:
            self.run.copy_(flat)
        else:
            self._copy_each(sources)

    def _copy_each(self, sources: list[th.Tensor]) -> None:
        """Copy each source into its copy (sources that do not tile one buffer)."""
        if all(s.device == self.device for s in sources):
            th._foreach_copy_(self.copies, sources)
        else:
            for copy_, source in zip(self.copies, sources, strict=True):
                copy_.copy_(source)

    def is_current(self) -> bool:
        """:return: whether every copy equals its source (for tests)"""
        return all(th.equal(c, s.detach().to(self.device)) for c, s in zip(self.copies, self.sources, strict=True))
