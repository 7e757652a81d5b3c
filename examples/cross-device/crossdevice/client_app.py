"""ClientApp: as the quickstart's, with a mod that can build the seeded round-0 model."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.clients import make_compression_mod
from crossdevice.task import load_data, make_model, train


def initial_model(context: Context):
    """The round-0 model every node builds from the run's seed: the SAME one the ServerApp passes
    as ``initial_arrays`` (same function, same seed). A node on first contact then gets the chain
    of compressed steps since round 0 instead of the full fp32 model."""
    return make_model(int(context.run_config["seed"])).state_dict()


app = ClientApp(mods=[make_compression_mod(initial_model=initial_model)])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data, _ = load_data(pid, parts)
    server_round = int(msg.content["config"]["server-round"])
    loss = train(model, data, int(cfg["local-epochs"]), float(cfg["lr"]), seed=1000 * server_round + pid)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"train_loss": loss, "num-examples": len(data[1])})}),
                   reply_to=msg)
