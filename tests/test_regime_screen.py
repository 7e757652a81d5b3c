"""fedcomp.simulations.regime_screen: wrapped settings on a regime cell, recorded with them."""

import json

import pytest

from fedcomp.simulations import regime_screen


def test_a_screen_run_records_its_settings_and_pins_a_default(tmp_path):
    out = tmp_path / "screen.jsonl"
    settings = {"server_momentum": 0.0, "patch": {"fedcomp.strategies.wrapper:robust_share": 0.1,
                                                  "fedcomp.strategies.resolution:robust_share": 0.1}}
    assert regime_screen.main(["silo:digits/mlp:FedMedian", json.dumps(settings), "--seeds", "0",
                               "--rounds", "2", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["settings"]["server_momentum"] == 0.0 and record["settings"]["patch"]
    assert "ratio=0.1)" in record["upload"] and record["upload"].startswith("sketch(")  # the pinned share
    assert record["planned_rounds"] == 2 and len(record["rounds"]) == 2
    from fedcomp.strategies import wrapper
    assert wrapper.robust_share.__name__ == "robust_share"  # the pin is undone after the runs


def test_bad_patch_target_and_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="'nomodule'"):
        regime_screen._pin("nomodule", 1)
    with pytest.raises(SystemExit):
        regime_screen.main(["silo:digits/mlp:FedAvg", "[1, 2]", "--out", str(tmp_path / "x.jsonl")])
