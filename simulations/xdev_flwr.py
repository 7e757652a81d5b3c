"""The cross-device defaults through the project's real app path: ``flwr run .`` on a SuperLink of its own.

Starts ``flower-superlink --simulation`` with a private ``FLWR_HOME`` and port, sets the number of
simulated nodes, runs ``flwr run . --run-config ...`` once per (scheme, seed), and stops the
SuperLink by its process group (only the one it started). Prints one line per run and a table:
final accuracy (the server's central evaluation), upload and download bytes against dense FedAvg
in the same regime (``upload='none()' download='none()'``), from each run's ``results.json``.

    python -m fedcomp.simulations.xdev_flwr --nodes 100 --fraction 0.1 --rounds 60 --seeds 0,1,2 \\
        --out /tmp/xdev-flwr          # defaults vs dense, cross-device
    python -m fedcomp.simulations.xdev_flwr --nodes 10 --fraction 1.0 --rounds 60 --seeds 0 --out /tmp/xdev-silo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fedcomp.simulations import deploy

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = {
    "dense": "upload='none()' download='none()' aggregation='decode'",
    "defaults": "",  # upload/download/aggregation 'auto' from pyproject.toml
}


def _superlink(home: Path, nodes: int) -> tuple[deploy.Proc, dict]:
    """A simulation SuperLink of its own (stopped with :func:`deploy.stop_process`), set to ``nodes``."""
    port = deploy.free_port()
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "xdev"\n\n[superlink.xdev]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = deploy.flower_env(home)
    proc = deploy._spawn("superlink", ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
                                       "--host", "127.0.0.1", "--port", str(port)], env, home / "superlink.log", home)
    import httpx

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"flower-superlink exited: {proc.log()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    subprocess.run(["flwr", "federation", "simulation-config", "--num-supernodes", str(nodes)],
                   env=env, check=True, capture_output=True, timeout=120)
    return proc, env


def summarize(results: Path) -> dict:
    data = json.loads(results.read_text())
    rounds = data["rounds"]
    up, up_dense = sum(r["upload_bytes"] for r in rounds), sum(r["upload_bytes_dense"] for r in rounds)
    down, down_dense = sum(r["download_bytes"] for r in rounds), sum(r["download_bytes_dense"] for r in rounds)
    modes: dict[str, int] = {}
    for r in rounds:
        for d in r["downloads"]:
            modes[d["mode"]] = modes.get(d["mode"], 0) + 1
    tail = [r["accuracy"] for r in rounds[-5:]]
    return {"accuracy": rounds[-1]["accuracy"], "accuracy_last5": sum(tail) / len(tail), "rounds": len(rounds), "upload_bytes": up, "download_bytes": down,
            "upload_x": up_dense / up if up else None, "download_x": down_dense / down if down else None,
            "download_modes": modes, "resolved": data["config"].get("resolved", {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--schemes", default="dense,defaults")
    ap.add_argument("--extra", default="", help="run-config overrides added to every run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/xdev-flwr"))
    args = ap.parse_args(argv)
    proc, env = _superlink(args.out / "flwr-home", args.nodes)
    rows = []
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for scheme in args.schemes.split(","):
                out = args.out / f"{scheme}-s{seed}"
                config = (f"num-server-rounds={args.rounds} fraction-train={args.fraction} seed={seed} "
                          f"{SCHEMES[scheme]} {args.extra} out-dir='{out}'")
                start = time.monotonic()
                done = subprocess.run(["flwr", "run", str(ROOT), "--stream", "--run-config", config],
                                      env=env, capture_output=True, text=True, timeout=6 * 3600)
                (args.out / f"{scheme}-s{seed}.log").write_text(done.stdout + done.stderr)
                if (out / "error.json").exists():  # the ServerApp stopped the run (e.g. NonFiniteModel)
                    print(f"{scheme} seed {seed}: stopped (flwr run exit {done.returncode}): "
                          f"{(out / 'error.json').read_text()}", flush=True)
                    continue
                if done.returncode != 0 or not (out / "results.json").exists():
                    print(f"{scheme} seed {seed}: flwr run failed (exit {done.returncode}); log in {args.out}",
                          flush=True)
                    continue
                row = {"scheme": scheme, "seed": seed, "seconds": round(time.monotonic() - start), **summarize(
                    out / "results.json")}
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.out / "rows.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        deploy.stop_process(proc)
    dense = {r["seed"]: r for r in rows if r["scheme"] == "dense"}
    print(f"\n{args.nodes} nodes, fraction-train {args.fraction}, {args.rounds} rounds")
    print("| scheme | seed | accuracy % | vs dense (pt) | last 5 rounds % | vs dense (pt) | upload x | download x | download modes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = dense.get(r["seed"])
        acc = f"{100 * r['accuracy']:.2f}"
        last5 = f"{100 * r['accuracy_last5']:.2f}"
        if d is None:
            print(f"| {r['scheme']} | {r['seed']} | {acc} | n/a | {last5} | n/a | | | {r['download_modes']} |")
            continue
        up = r["upload_bytes"] and d["upload_bytes"] / r["upload_bytes"]
        down = r["download_bytes"] and d["download_bytes"] / r["download_bytes"]
        print(f"| {r['scheme']} | {r['seed']} | {acc} | {100 * (r['accuracy'] - d['accuracy']):+.2f} | {last5} | "
              f"{100 * (r['accuracy_last5'] - d['accuracy_last5']):+.2f} | {up:.1f} | {down:.1f} | "
              f"{r['download_modes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
