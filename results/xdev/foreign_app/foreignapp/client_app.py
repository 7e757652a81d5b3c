from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from fedcomp.clients import compression_mod
from foreignapp.task import make_model, shard, fit

app = ClientApp(mods=[compression_mod])

@app.train()
def train(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = shard(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    n = fit(model, x, y)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)
