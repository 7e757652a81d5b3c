"""family_study's table: gaps and byte ratios against the dense run of the same regime and seed."""

from __future__ import annotations

import json

from fedcomp.simulations.family_study import FAMILIES, table


def _run(spec, accs, up, seed=0, clients=10, fraction=1.0):
    return {"family": spec.partition("(")[0], "spec": spec, "upload": spec, "task": "mnist", "model": "cnn-bn",
            "clients": clients, "fraction": fraction, "seed": seed, "lr": 0.05, "strategy": "FedAvg",
            "rounds": [{"round": i + 1, "accuracy": a, "upload_bytes": up, "finite": True} for i, a in enumerate(accs)]}


def test_table_compares_each_spec_with_dense_of_its_regime_and_seed(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [_run("dense", [0.5] + [0.9] * 5, 8000), _run("topk()", [0.1] + [0.8] * 5, 100),
            _run("dense", [0.7] * 6, 8000, seed=1), _run("topk()", [0.6] * 6, 400, seed=1),
            _run("dense", [0.2] * 6, 8000, clients=100, fraction=0.1),
            {"family": "sign", "spec": "sign()", "task": "mnist", "model": "cnn-bn", "clients": 10, "fraction": 1.0,
             "seed": 0, "planned_rounds": 6, "stopped": "non-finite model"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = table(path)
    # seeds 0 and 1: (80 - 90 + 60 - 70) / 2 = -10 points, (80 + 20) / 2 = 50x fewer bytes
    assert "| topk | `topk()` | 70.00 | 80.00 | -10.00 | 50.0 | 2 | yes |" in out
    assert "| sign | `sign()` | stopped |" in out
    assert "100 clients x 0.1 per round" in out and out.count("| dense |") == 2
    assert set(FAMILIES) >= {"topk", "dgc", "sketch", "sign", "kbit", "qsgd", "terngrad", "powersgd"}
