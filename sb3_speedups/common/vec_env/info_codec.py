"""
A compact, lossless encoding of the info records a worker sends each step.

MuJoCo-style envs return the same flat info every step (``x_position``, ``reward_ctrl``, ... as numpy scalars).
Pickling numpy scalars is slow (each goes through ``__reduce__`` with its dtype), so a flat info whose values are
all plain scalars travels as ``(env index, schema id, plain Python values)``; the schema (keys and exact types) is
sent once, the first time it appears, and the receiver rebuilds each value with its exact type (``np.float32(x)``
of ``float(np.float32(...))`` is the same number, and so on). Any other record (an episode end with its terminal
observation, nested values) is pickled as it is.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from sb3_speedups.common.vec_env.env_group import InfoRecord

# Types whose values round-trip exactly through ``.item()`` and back through the type itself.
_NUMPY_SCALARS = frozenset(np.dtype(code).type for code in "?bBhHiIlLqQefd")
# Immutable Python types sent as they are.
_PLAIN = frozenset({bool, int, float, str, type(None)})

Schema = tuple[tuple[Any, ...], tuple[type, ...]]


class InfoEncoder:
    """Worker side: turns a step's info records into bytes."""

    def __init__(self) -> None:
        self._ids: dict[Schema, int] = {}

    def encode(self, records: list[InfoRecord]) -> bytes:
        """
        :param records: ``(env index, info, reset info or None)`` per env with something to report
        :return: the pickled ``(new schemas, items)``
        """
        new_schemas: list[tuple[int, Schema]] = []
        items: list[tuple[Any, ...]] = []
        numpy_scalars, plain = _NUMPY_SCALARS, _PLAIN
        for record in records:
            index, info, reset_info = record
            if reset_info is None:
                types = tuple(map(type, info.values()))
                if all(t in plain or t in numpy_scalars for t in types):
                    schema = (tuple(info), types)
                    schema_id = self._ids.get(schema)
                    if schema_id is None:
                        schema_id = self._ids[schema] = len(self._ids)
                        new_schemas.append((schema_id, schema))
                    values = [v.item() if t in numpy_scalars else v for t, v in zip(types, info.values(), strict=True)]
                    items.append((index, schema_id, values))
                    continue
            items.append(record)
        return pickle.dumps((new_schemas, items), protocol=pickle.HIGHEST_PROTOCOL)


class InfoDecoder:
    """Main-process side of one worker's :class:`InfoEncoder`."""

    def __init__(self) -> None:
        self._schemas: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}

    def decode(self, data: bytes | memoryview) -> list[InfoRecord]:
        """:return: the records as the worker's envs produced them (same keys, values and types)"""
        new_schemas, items = pickle.loads(data)
        for schema_id, (keys, types) in new_schemas:
            self._schemas[schema_id] = (keys, tuple(t if t in _NUMPY_SCALARS else None for t in types))
        records: list[InfoRecord] = []
        for item in items:
            if len(item) == 3 and type(item[1]) is int:
                index, schema_id, values = item
                keys, makers = self._schemas[schema_id]
                info = {k: v if m is None else m(v) for k, m, v in zip(keys, makers, values, strict=True)}
                records.append((index, info, None))
            else:
                records.append(item)  # type: ignore[arg-type]
        return records
