"""The regime x model x strategy table (``simulations/regime_table.py``): cells, verdicts, resumption."""

import json

import pytest

from fedcomp.simulations import regime_table as rt


def _run(regime, strategy, wrapped, seed, acc, *, up=1000, up_dense=100_000, down=1000, down_dense=100_000,
         commit="abc", error=None, planned=None):
    rounds = [{"round": i + 1, "accuracy": acc / 100, "loss": 0.1, "upload_bytes": up, "download_bytes": down,
               "upload_bytes_dense": up_dense, "download_bytes_dense": down_dense} for i in range(6)]
    return {"regime": regime, "task": "digits", "model": "mlp", "strategy": strategy, "wrapped": wrapped,
            "seed": seed, "upload": "u" if wrapped else "dense", "download": "", "aggregation": "decode",
            "error": error, "seconds": 1.0, "commit": commit, "date": "2026-11-27 18:00 UTC", "rounds": rounds,
            "planned_rounds": planned or rt.REGIMES[regime][2]}


def test_parse_cells_checks_every_part():
    cells = rt.parse_cells("xdev:digits/mlp:FedAvg,Krum")
    assert [c.key for c in cells] == [("xdev", "digits", "mlp", "FedAvg"), ("xdev", "digits", "mlp", "Krum")]
    for bad, word in [("cloud:digits/mlp:FedAvg", "regime 'cloud'"), ("silo:digits/resnet:FedAvg", "resnet"),
                      ("silo:digits/mlp:FedFoo", "FedFoo"), ("silo-digits-mlp", "expected")]:
        with pytest.raises(ValueError, match=word):
            rt.parse_cells(bad)


def test_verdict_pairs_seeds_and_checks_bytes():
    runs = [_run("silo", "FedAvg", False, s, 90 + s) for s in (0, 1, 2)]
    runs += [_run("silo", "FedAvg", True, s, 89.5 + s) for s in (0, 1, 2)]  # -0.5 each: holds at 100x
    runs += [_run("xdev", "FedAvg", False, s, 80) for s in (0, 1)]
    runs += [_run("xdev", "FedAvg", True, s, 80, down=5000) for s in (0, 1)]  # 20x down: fails cross-device
    runs += [_run("silo", "Krum", False, 0, 70), _run("silo", "Krum", True, 0, 68.5)]  # -1.5, spread 0: fails
    rows = {(r["regime"], r["strategy"]): r for r in rt.summarize(runs)}
    silo = rows[("silo", "FedAvg")]
    assert silo["holds"] and silo["gap"] == pytest.approx(-0.5) and silo["up"] == pytest.approx(100)
    assert silo["seeds"] == [0, 1, 2] and silo["plain_spread"] == pytest.approx(2.0)
    assert not rows[("xdev", "FedAvg")]["holds"] and rows[("xdev", "FedAvg")]["down"] == pytest.approx(20)
    assert not rows[("silo", "Krum")]["holds"]
    table = rt.table(runs)
    assert "| cross-silo 10/10 | digits / `mlp` | FedAvg | 3 |" in table and "**no**" in table


def test_spread_widens_the_allowance_and_errors_fail_the_cell():
    runs = [_run("silo", "FedAvg", False, 0, 90), _run("silo", "FedAvg", False, 1, 94)]  # spread 4 points
    runs += [_run("silo", "FedAvg", True, 0, 88.5), _run("silo", "FedAvg", True, 1, 92.5)]  # -1.5
    (row,) = rt.summarize(runs)
    assert row["allowed"] == 2.0 and row["holds"]
    runs[-1] = _run("silo", "FedAvg", True, 1, 92.5, error="NoUsableReplies: none")
    assert not rt.summarize(runs)[0]["holds"]


def test_latest_record_wins_and_short_checks_stay_out():
    runs = [_run("silo", "FedAvg", False, 0, 90), _run("silo", "FedAvg", True, 0, 70),
            _run("silo", "FedAvg", True, 0, 91), _run("silo", "FedAvg", True, 0, 10, planned=2)]
    (row,) = rt.summarize(runs)
    assert row["wrapped"] == pytest.approx(91)


def test_main_resumes_and_reruns_wrapped_runs_on_request(tmp_path, monkeypatch):
    calls = []

    def fake(cell, wrapped, seed, rounds=None):
        calls.append((cell.strategy, wrapped, seed))
        return _run(cell.regime, cell.strategy, wrapped, seed, 90)

    monkeypatch.setattr(rt, "run_one", fake)
    out = tmp_path / "t.jsonl"
    cells = ["--cells", "silo:digits/mlp:FedAvg", "--seeds", "0", "1", "--out", str(out)]
    rt.main(cells)
    assert len(calls) == 4
    rt.main(cells)
    assert len(calls) == 4  # all there
    rt.main(cells + ["--rerun"])
    assert calls[4:] == [("FedAvg", True, 0), ("FedAvg", True, 1)]  # baselines kept, wrapped redone
    assert len([json.loads(x) for x in out.read_text().splitlines()]) == 6


def test_one_real_run_records_bytes_per_round():
    cell = rt.parse_cells("silo:digits/mlp:FedAvg")[0]
    run = rt.run_one(cell, True, 0, rounds=1)
    (row,) = run["rounds"]
    assert run["upload"].startswith("topk(") and run["planned_rounds"] == 1
    assert 0 < row["upload_bytes"] < row["upload_bytes_dense"] / 50
