from flwr.app import ArrayRecord, Context
from flwr.server import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg
from fedcomp.strategies import CompressedStrategy
from foreignapp.task import make_model, accuracy

app = ServerApp()

@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    upload = str(context.run_config["upload"])
    strategy = CompressedStrategy(FedAvg(fraction_train=0.2, fraction_evaluate=0.0), upload=upload, download=str(context.run_config["download"]))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model().state_dict()), num_rounds=rounds)
    model = make_model(); model.load_state_dict(result.arrays.to_torch_state_dict())
    up = sum(r.upload_bytes for r in strategy.rounds.values()); dense = sum(r.upload_bytes_dense for r in strategy.rounds.values())
    print(f"FOREIGN upload={upload} download={context.run_config['download']} rounds={rounds} final_accuracy={accuracy(model):.4f} "
          f"upload_bytes={up} dense={dense} ratio={dense / up:.2f} download_bytes={sum(r.download_bytes for r in strategy.rounds.values())} download_dense={sum(r.download_bytes_dense for r in strategy.rounds.values())}", flush=True)
