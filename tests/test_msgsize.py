"""fedcomp.msgsize.message_bytes equals Flower's own serialized size of a message's content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.msgsize import message_bytes


def flower_bytes(obj) -> int:
    """The oracle: Flower's deflated objects (what it pushes), distinct objects once."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(o.deflate()) for o in get_all_nested_objects(obj).values())


def test_typical_reply_and_broadcast():
    payload = bytes(range(256)) * 40
    content = RecordDict({
        "fedcomp.upload": ConfigRecord({"payload": payload, "arrays-key": "arrays", "tier": 0, "ref-crc": 2**32 - 1,
                                        "delta": 0.25, "error-feedback": True, "payloads": [payload, b"x"],
                                        "rounds": [1, 2, 3], "neg": -7, "big": 2**63 + 5, "names": ["a", "é"],
                                        "flags": [True, False], "floats": [0.5, 1e300], "empty": [], "": 1}),
        "metrics": MetricRecord({"num-examples": 120, "train_loss": 0.31, "vals": [1.0, 2.0], "ints": [-1, 2**40]}),
        "arrays": ArrayRecord({"w": torch.randn(30, 20), "b": torch.zeros(20), "steps": torch.tensor(3)}),
    })
    assert message_bytes(content) == flower_bytes(content)
    for record in content.values():
        assert message_bytes(record) == flower_bytes(record)


def test_multi_chunk_arrays_and_repeated_objects(monkeypatch):
    import fedcomp.msgsize as M
    import flwr.app.message.array as flower_array

    monkeypatch.setattr(M, "CHUNK", 1000)
    monkeypatch.setattr(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 1000)
    zeros = np.zeros(2000, dtype=np.float32)  # identical chunks: sent once
    rnd = np.random.default_rng(0).standard_normal(1500).astype(np.float32)
    content = RecordDict({
        "a": ArrayRecord({"z": Array(zeros), "r": Array(rnd), "z2": Array(zeros.copy())}),
        "b": ArrayRecord({"r": Array(rnd.copy())}),
        "m1": MetricRecord({"x": 1.0}), "m2": MetricRecord({"x": 1.0}),  # identical records: once
        "c": ConfigRecord({"x": 1}), "d": ConfigRecord({"x": True}),  # equal in Python, not on the wire
    })
    assert message_bytes(content) == flower_bytes(content)


_values = st.one_of(
    st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=20), st.binary(max_size=300),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=5),
    st.lists(st.floats(allow_nan=False), max_size=5), st.lists(st.text(max_size=5), max_size=4),
    st.lists(st.binary(max_size=9), max_size=4), st.lists(st.booleans(), max_size=4),
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _values, max_size=6),
       st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(st.floats(allow_nan=False), st.integers(-2**63, 2**63 - 1)),
                       max_size=4))
def test_config_and_metric_records_match_flower(config, metrics):
    content = RecordDict({"c": ConfigRecord(config), "m": MetricRecord(metrics)})
    assert message_bytes(content) == flower_bytes(content)


def test_refuses_unknown_record_types():
    with pytest.raises(TypeError):
        message_bytes({"x": 1})
