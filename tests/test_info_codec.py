"""The compact info encoding between BatchedSubprocVecEnv workers and the main process."""

import pickle

import numpy as np

from sb3_speedups.common.vec_env.info_codec import InfoDecoder, InfoEncoder


def mujoco_like_info(x: float) -> dict:
    return {
        "x_position": np.float64(x),
        "reward_ctrl": np.float32(-x / 3),
        "steps": np.int64(7),
        "ok": np.bool_(True),
        "plain": 0.1,
        "n": 3,
        "TimeLimit.truncated": False,
    }


def assert_same_records(decoded, records):
    assert len(decoded) == len(records)
    for (i, info, reset), (j, info2, reset2) in zip(decoded, records, strict=True):
        assert i == j and list(info) == list(info2)
        for key in info:
            assert type(info[key]) is type(info2[key]), key
            np.testing.assert_array_equal(info[key], info2[key])
        assert (reset is None) == (reset2 is None)


def test_flat_scalar_infos_round_trip_with_their_exact_types():
    encoder, decoder = InfoEncoder(), InfoDecoder()
    for step in range(3):
        records = [(i, mujoco_like_info(step + i / 7), None) for i in range(4)]
        data = encoder.encode(records)
        new_schemas, items = pickle.loads(data)
        assert len(new_schemas) == (1 if step == 0 else 0)  # the schema travels once
        assert all(type(item[1]) is int for item in items)
        assert_same_records(decoder.decode(data), records)


def test_other_records_travel_as_they_are():
    encoder, decoder = InfoEncoder(), InfoDecoder()
    end = (0, {**mujoco_like_info(1.0), "terminal_observation": np.arange(3.0)}, {"reset": np.float32(2)})
    nested = (1, {"episode": {"r": 1.0, "l": 5}, "TimeLimit.truncated": False}, None)
    array = (2, {"contacts": np.zeros(2)}, None)
    flat = (3, mujoco_like_info(2.0), None)
    decoded = decoder.decode(encoder.encode([end, nested, array, flat]))
    assert decoded[0][0] == 0 and decoded[0][2] == {"reset": np.float32(2)}
    np.testing.assert_array_equal(decoded[0][1]["terminal_observation"], np.arange(3.0))
    assert decoded[1] == nested
    np.testing.assert_array_equal(decoded[2][1]["contacts"], np.zeros(2))
    assert_same_records(decoded[3:], [flat])


def test_a_changed_schema_is_sent_again():
    encoder, decoder = InfoEncoder(), InfoDecoder()
    first = [(0, {"a": np.float64(1.0)}, None)]
    second = [(0, {"a": np.float32(1.0)}, None), (1, {"a": np.float64(2.0), "b": 1}, None)]
    assert_same_records(decoder.decode(encoder.encode(first)), first)
    assert_same_records(decoder.decode(encoder.encode(second)), second)
