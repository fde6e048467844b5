"""
What every drop-in algorithm of this package does around its speed-only state, in one place: the torch thread and
allocator settings at setup, the ``_speedups`` attribute that is rebuilt when needed and never saved, and the
``fast_update`` switch in front of the algorithm's own reasons for the autograd fallback; and, from
:class:`~sb3_speedups.common.training_mode.FastTrainingMode`, the kept training-mode switch.

Use it first among the bases of a stock algorithm, before the other mixins::

    class A2C(FastModel, stable_baselines3.A2C): ...

The subclass sets ``num_threads`` and ``fast_update`` in ``__init__``, implements :meth:`FastModel._unsupported_reason`
and may hook :meth:`FastModel._close_speedups` (before stock's setup) and :meth:`FastModel._after_stock_setup` (after it).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sb3_speedups.common.torch_utils import apply_num_threads, keep_freed_blocks
from sb3_speedups.common.training_mode import FastTrainingMode


class FastModel(FastTrainingMode):
    """Mixin: setup, saving and the fast-path switch shared by the drop-in algorithms (see the module docstring)."""

    #: torch CPU threads (``None``: keep a value the user set, else the package default)
    num_threads: int | None = None
    #: take the hand-derived update where the model allows it
    fast_update: bool = True
    #: the speed-only state (updaters, frozen actors, kept buffers), rebuilt when missing or stale
    _speedups: Any = None
    #: attributes that hold speed-only state: never saved, rebuilt after loading
    speed_only_attributes: ClassVar[tuple[str, ...]] = ("_speedups",)

    def _setup_model(self) -> None:
        self._close_speedups()
        apply_num_threads(self.num_threads)
        super()._setup_model()  # type: ignore[safe-super]  # a mixin: the stock class after it implements it
        apply_num_threads(self.num_threads, self.policy)  # type: ignore[attr-defined]  # by the network's shapes
        keep_freed_blocks(self.policy, self.device)  # type: ignore[attr-defined]
        self._after_stock_setup()
        self._speedups = None

    def _close_speedups(self) -> None:
        """Release what the speed-only state holds outside this process (nothing here; PPO stops its helper)."""

    def _after_stock_setup(self) -> None:
        """Replace what stock's ``_setup_model`` built with this package's versions (nothing here)."""

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), *self.speed_only_attributes]

    def fast_path_unsupported_reason(self) -> str | None:
        """:return: why the hand-derived update cannot run this model (so the fallback does), or ``None``"""
        if not self.fast_update:
            return "fast_update=False"
        return self._unsupported_reason()

    def _unsupported_reason(self) -> str | None:
        """:return: why the algorithm's hand-derived update cannot run this model, or ``None``"""
        raise NotImplementedError
