"""Flower's quickstart app in process (``simulations/quickstart_study.py``): schemes and one short run."""

import pytest

from fedcomp.simulations import quickstart_study as qs


def test_schemes_parse_to_wrapper_settings():
    assert qs.parse_scheme("dense") == (False, {})
    assert qs.parse_scheme("defaults") == (True, {})
    assert qs.parse_scheme("upload=topk(ratio=0.01)+qsgd(bits=4);server_momentum=0.5") == (
        True, {"upload": "topk(ratio=0.01)+qsgd(bits=4)", "server_momentum": 0.5})
    with pytest.raises(ValueError, match="key=value"):
        qs.parse_scheme("topk()")


def test_a_round_of_the_app_with_the_defaults_counts_its_bytes():
    record = qs.run(0, 1, True, clients=3)
    assert record["upload"].startswith("topk(") and len(record["accuracy"]) == 2
    assert record["upload_x"] > 50 and record["download_x"] == pytest.approx(1.0, rel=0.05)  # dense broadcasts
    dense = qs.run(0, 1, False, clients=3)
    assert dense["upload_x"] == 1.0 and dense["accuracy"][0] == record["accuracy"][0]  # same seeded model
