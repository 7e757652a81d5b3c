"""Smoke tests of the closed-loop studies at tiny sizes: they run, record what they claim, and plot."""

from __future__ import annotations

import json

from fedcomp.simulations import adapt_study, link_study


def test_adapt_study_tiny(tmp_path):
    adapt_study.main(["--models", "mlp", "--rounds", "2", "--clients", "2", "--ratios", "--jobs", "1",
                      "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    runs = {r["upload"]: r for r in data["models"]["mlp"]["runs"]}
    assert set(runs) == {"none()", "topk(ratio=auto)+qsgd(bits=4)"}
    auto = runs["topk(ratio=auto)+qsgd(bits=4)"]["rounds"]
    assert [r["round"] for r in auto] == [1, 2]
    assert all(0 < r["strength"] < 0.01 and r["upload_spec"].startswith("topk(ratio=") for r in auto)
    assert all(r["decision"] in ("hold", "tighten", "relax", "revert") for r in auto)
    verdict = data["models"]["mlp"]["verdict"]
    assert verdict["best_fixed"] is None and verdict["bytes_le_best_fixed"] is False  # no fixed ratio ran
    assert "| `topk(ratio=auto)+qsgd(bits=4)` |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "mlp.png").stat().st_size > 0


def test_link_study_tiny(tmp_path):
    link_study.main(["--clients", "6", "--rounds", "6", "--jitter", "0.02", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "links.json").read_text())
    rows = data["runs"][0]["rows"]
    assert len(rows) == 36 and {r["node"] for r in rows} == set(range(6))
    assert all(r["budget"] >= 1 and r["declared"] >= 1 and "on_time" in r for r in rows)
    assert (tmp_path / "links.png").stat().st_size > 0

