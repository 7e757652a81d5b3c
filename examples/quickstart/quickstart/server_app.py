"""ServerApp: FedAvg over every node every round, wrapped in ``CompressedStrategy``."""

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.server import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.strategies import CompressedStrategy
from quickstart.task import load_data, make_model, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    seed = int(cfg["seed"])
    strategy = CompressedStrategy(  # 2. the wrapper, around any Flower strategy
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
        upload=str(cfg["upload"]), download=str(cfg["download"]), seed=seed)
    _, test_data = load_data(0, 1)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, test_data)
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model(seed).state_dict()),
                            num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate)

    # what the run cost on the wire: strategy.rounds holds one RoundStats per round
    up = sum(r.upload_bytes for r in strategy.rounds.values())
    up_dense = sum(r.upload_bytes_dense for r in strategy.rounds.values())
    down = sum(r.download_bytes for r in strategy.rounds.values())
    down_dense = sum(r.download_bytes_dense for r in strategy.rounds.values())
    last = max(result.evaluate_metrics_serverapp)
    print(f"fedcomp quickstart: accuracy {result.evaluate_metrics_serverapp[last]['accuracy']:.4f} after "
          f"{last} rounds | upload {up:,} B ({up_dense / up:.1f}x less than dense) | "
          f"download {down:,} B ({down_dense / down:.1f}x less than dense)")
