"""Smoke tests of the benchmark and sweep scripts at tiny sizes: they run and their numbers are sane."""

from __future__ import annotations

import json
import math

from fedcomp.simulations import bench_codecs, bench_server, bench_wire, profile_encode, sweep


def test_bench_wire_bounds(tmp_path):
    out = tmp_path / "wire.json"
    bench_wire.main(["--n", "20000", "--ratios", "0.01", "--json", str(out)])
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    rice = rows["topk(ratio=0.01)+qsgd(bits=4)"]
    assert rice["kept"] == 200
    # Rice coding sits above the information limit, and not far (headers included)
    assert rice["index_bound_bits"] < rice["index_bits_per_kept"] < 1.1 * rice["index_bound_bits"]
    assert rows["topk(ratio=0.01,index='fixed')"]["index_bits_per_kept"] > rice["index_bits_per_kept"]
    assert 0 < rice["symbol_entropy_bits"] <= 4.0 <= rice["value_bits_per_kept"]
    assert rows["none()"]["payload_bytes"] == 4 * 20000 + 28


def test_bench_codecs_rows(tmp_path):
    out = tmp_path / "codecs.json"
    bench_codecs.main(["--sizes", "10000", "--repeats", "1", "--cpu-only", "--json", str(out),
                       "--codecs", "kbit(bits=4)", "topk(ratio=0.001)+qsgd(bits=4)"])
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["kbit(bits=4)", "topk(ratio=0.001)+qsgd(bits=4)"]
    for r in rows:
        assert r["size"] == 10000 and r["read_s"] > 0
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("encode_x", "decode_x", "decode_acc_x"))
    assert rows[1]["encode_target_x"] == 5.0 and rows[0]["encode_target_x"] == 3.0
    bench_codecs.main(["--sizes", "10000", "--repeats", "1", "--cpu-only", "--json", str(out), "--dtype", "bf16",
                       "--codecs", "kbit(bits=4)"])  # a bf16 model: its values rounded at the server
    row, = json.loads(out.read_text())
    assert row["layout"] == "10,000 bf16 (100 x 100)" and row["payload_bytes"] == rows[0]["payload_bytes"]
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("encode_x", "decode_x", "decode_acc_x"))


def test_profile_encode_counts_ops_per_tensor(tmp_path, monkeypatch):
    from fedcomp import kernels

    monkeypatch.setattr(kernels, "for_encode", lambda: None)  # the torch path, as on a GPU
    out = tmp_path / "profile.json"
    profile_encode.main(["--device", "cpu", "--scale", "0.05", "--repeats", "1", "--json", str(out),
                         "--codecs", "terngrad()", "none()"])
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    assert rows["terngrad()"]["tensors"] == 161 and rows["terngrad()"]["numel"] > 10000
    assert rows["terngrad()"]["aten_ops"] > 161 and not rows["terngrad()"]["cpu_kernels"]  # torch ops per tensor
    assert all(r["layout_encode_s"] > 0 and r["one_tensor_encode_s"] > 0 for r in rows.values())
    assert all(r["kernel_launches"] == r["host_copies"] == 0 and r["device_busy_s"] is None for r in rows.values())


def test_bench_server_memory_rows(tmp_path):
    out = tmp_path / "server.json"
    bench_server.main(["--params", "50000", "--clients", "2", "4", "--codecs", "topk(ratio=0.01)+qsgd(bits=4)",
                       "--distinct", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["clients"] for r in rows] == [2, 4]
    assert rows[1]["payload_bytes"] == 2 * rows[0]["payload_bytes"]
    for r in rows:
        assert r["params"] >= 45000 and r["dense_bytes"] == 4 * (r["params"] - 1) + 8
        assert r["seconds_per_client"] > 0 and r["peak_above_base_bytes"] >= 0


def test_sweep_tiny(tmp_path):
    sweep.main(["--rounds", "2", "--clients", "3", "--jobs", "1", "--out", str(tmp_path),
                "--codecs", "topk(ratio=0.01)+qsgd(bits=4)", "kbit(bits=8):noef"])
    data = json.loads((tmp_path / "sweep.json").read_text())
    summary = {(s["upload"], s["error_feedback"]): s for s in data["summary"]}
    assert set(summary) == {("none()", False), ("topk(ratio=0.01)+qsgd(bits=4)", True), ("kbit(bits=8)", False)}
    dense = summary[("none()", False)]
    assert abs(dense["reduction"] - 1.0) < 0.01 and dense["delta_points"] == 0
    assert summary[("topk(ratio=0.01)+qsgd(bits=4)", True)]["reduction"] > 100
    assert 3 < summary[("kbit(bits=8)", False)]["reduction"] < 4.1
    for run in data["runs"]:
        assert [r["round"] for r in run["rounds"]] == [1, 2]
        assert all(0 <= r["accuracy"] <= 1 and r["upload_bytes"] > 0 for r in run["rounds"])
    assert "| `none()` | off |" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep_accuracy_vs_upload.png").stat().st_size > 0
    assert (tmp_path / "sweep_accuracy_vs_round.png").stat().st_size > 0


def test_strategy_study_tiny(tmp_path):
    from fedcomp.simulations import strategy_study

    out = tmp_path / "runs.jsonl"
    strategy_study.main(["FedAvg", "FedMedian", "--rounds", "1", "--clients", "3", "--out", str(out)])
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["strategy"], r["wrapped"]) for r in runs] == [("FedAvg", False), ("FedAvg", True),
                                                            ("FedMedian", False), ("FedMedian", True)]
    uploads = {(r["strategy"], r["wrapped"]): r["upload"] for r in runs}
    # the robust strategy aggregates in sketch space (strategies/robust_sketch.py)
    assert uploads[("FedMedian", True)].startswith("sketch(") and uploads[("FedAvg", True)].startswith("topk(")
    dense, compressed = runs[0]["rounds"][0]["upload_bytes"], runs[1]["rounds"][0]["upload_bytes"]
    assert dense > 100 * compressed  # the wrapped FedAvg run really compressed
    table = strategy_study.table(out)
    assert "| FedMedian |" in table and "`sketch(" in table


def test_strategy_study_runs_of_one_seed_are_the_same_whatever_ran_before():
    """Flower samples nodes with the process-global random: run_one seeds it, so a seed trains the same
    clients each round (and the dense and compressed runs of a seed are paired)."""
    import random

    from fedcomp.simulations import strategy_study

    def run():
        random.random()  # whatever ran before in the process
        return strategy_study.run_one("FedAvg", False, task_name="digits", model_name="mlp", rounds=2, clients=10,
                                      fraction=0.2, lr=0.3, seed=3)["rounds"]

    first = run()
    random.seed(12345)
    assert run() == first


def test_bench_fresh_times_both_ways_and_restores_the_threshold(tmp_path):
    from fedcomp import steps, wire
    from fedcomp.simulations import bench_fresh

    out = tmp_path / "fresh.json"
    rows = bench_fresh.main(["--n", "20000", "--repeats", "1", "--json", str(out)])
    assert len(rows) == len(bench_fresh.DECODE) + 2 + len(bench_fresh.ROUND) + len(bench_fresh.CLIENT)
    assert all(r["torch_x"] > 0 and r["fresh_x"] > 0 for r in rows)
    assert json.loads(out.read_text())["n"] == 20000
    assert wire.MMAPPED == steps.MMAPPED == 32 << 20
    assert steps in bench_fresh._holders()
