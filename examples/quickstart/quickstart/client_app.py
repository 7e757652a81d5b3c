"""ClientApp: trains on this node's share of digits; ``compression_mod`` compresses the reply."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.clients import compression_mod
from quickstart.task import load_data, make_model, train

app = ClientApp(mods=[compression_mod])  # 1. the mod: decodes broadcasts, compresses replies


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # the dense model, as usual
    data, _ = load_data(pid, parts)
    server_round = int(msg.content["config"]["server-round"])
    loss = train(model, data, int(cfg["local-epochs"]), float(cfg["lr"]), seed=1000 * server_round + pid)
    # reply with the trained model, as in any Flower app: the mod turns it into a compressed update
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"train_loss": loss, "num-examples": len(data[1])})}),
                   reply_to=msg)
