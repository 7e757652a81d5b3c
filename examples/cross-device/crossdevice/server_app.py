"""ServerApp: a fraction of the nodes per round, first contact from the seeded round-0 model."""

import random
from collections import Counter

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.server import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.strategies import CompressedStrategy
from crossdevice.task import load_data, make_model, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    seed = int(cfg["seed"])
    random.seed(seed)  # Flower's strategies sample nodes with the process-global random: the seed fixes who trains
    strategy = CompressedStrategy(
        FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=0.0, min_train_nodes=1),
        upload=str(cfg["upload"]), download=str(cfg["download"]), seed=seed,
        seeded_init=True)  # nodes build the round-0 model themselves (client_app.initial_model)
    _, test_data = load_data(0, 1)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, test_data)
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    # The pitfall: initial_arrays MUST be the model the clients' initial_model builds (same
    # function, same seed). Another model here (e.g. make_model() with another seed) and every
    # node's first chain starts from a model it does not hold: it asks for a resync, skips that
    # round and gets the full model next round (a warning per node names the CRCs).
    initial = ArrayRecord(make_model(seed).state_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["num-server-rounds"]),
                            evaluate_fn=evaluate)

    rounds = strategy.rounds.values()
    up = sum(r.upload_bytes for r in rounds)
    up_dense = sum(r.upload_bytes_dense for r in rounds)
    down = sum(r.download_bytes for r in rounds)
    down_dense = sum(r.download_bytes_dense for r in rounds)
    modes = Counter(d["mode"] for r in rounds for d in r.downloads)
    resyncs = sum(str(c["status"]).startswith("resync") for r in rounds for c in r.clients)
    last = max(result.evaluate_metrics_serverapp)
    print(f"fedcomp cross-device: accuracy {result.evaluate_metrics_serverapp[last]['accuracy']:.4f} after "
          f"{last} rounds | upload {up:,} B ({up_dense / up:.1f}x less than dense) | "
          f"download {down:,} B ({down_dense / down:.1f}x less than dense) | "
          f"broadcasts: {modes['chain']} chains, {modes['full']} full models | resyncs: {resyncs}")
