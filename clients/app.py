"""The project's ClientApp: trains the task model on its partition; ``compression_mod`` compresses.

Run config keys read here: ``model``, ``local-epochs``, ``lr``, ``batch-size``, ``seed``,
``partition-alpha``. Node config: ``partition-id``, ``num-partitions`` (given by the simulation
engine, or by ``flower-supernode --node-config``), optional ``device`` (``cpu``, ``cuda``...).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.mod import compression_mod, node_device
from simulations import task

app = ClientApp(mods=[compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    seed = int(cfg["seed"])
    model = task.build_model(str(cfg["model"]), seed=seed)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    train_set, _ = task.load_digits_split(seed=seed)
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = task.partition(train_set, parts, pid, float(cfg["partition-alpha"]), seed)
    server_round = int(msg.content.config_records["config"].get("server-round", 0))
    loss = task.train(
        model, x, y,
        epochs=int(cfg["local-epochs"]), lr=float(cfg["lr"]), batch_size=int(cfg["batch-size"]),
        seed=seed * 100_003 + server_round * 1009 + pid, device=node_device(context),
    )
    model.cpu()
    return Message(
        RecordDict({
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": float(loss), "num-examples": int(x.shape[0])}),
        }),
        reply_to=msg,
    )
