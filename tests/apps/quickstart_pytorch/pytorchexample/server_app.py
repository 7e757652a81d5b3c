"""pytorchexample: the quickstart's ServerApp, FedAvg wrapped in fedcomp's CompressedStrategy."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.strategies import CompressedStrategy
from pytorchexample.task import Net, load_centralized_dataset
from pytorchexample.task import test as test_fn

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    fraction_train: float = context.run_config["fraction-train"]
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]

    arrays = ArrayRecord(Net().state_dict())
    strategy = CompressedStrategy(FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate))
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )
    print(f"final model: {sum(a.numel() for a in result.arrays.to_torch_state_dict().values())} parameters")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the held-out digits."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    loss, accuracy = test_fn(model, load_centralized_dataset(), device)
    return MetricRecord({"accuracy": accuracy, "loss": loss})
