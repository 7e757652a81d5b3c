"""The project's ClientApp: trains the task model on its partition (``compression_mod`` compresses
the reply) and, when the run config's ``fraction-evaluate`` is above 0, evaluates the model it is
sent on that partition.

Run config keys read here: ``task`` (default ``digits``), ``model``, ``local-epochs``, ``lr``,
``batch-size``, ``seed``, ``partition-alpha``. Data loading is memoised per process
(``fedcomp.simulations.task``), so only a worker's first message pays for it. Node config: ``partition-id``, ``num-partitions`` (given by the simulation
engine, or by ``flower-supernode --node-config``), optional ``device`` (``cpu``, ``cuda``...).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.simulations.faults import faults_mod
from fedcomp.simulations.netsim import netsim_mod
from fedcomp.clients.mod import make_compression_mod, node_device
from fedcomp.simulations import task


def initial_model(context: Context) -> dict[str, torch.Tensor]:
    """The round-0 model the ServerApp starts from, built from the run's seed: a node's first
    broadcast is then the chain of compressed steps since round 0, not the full model."""
    cfg = context.run_config
    return task.build_model(str(cfg["model"]), seed=int(cfg["seed"]), task=str(cfg.get("task", "digits"))).state_dict()


# faults_mod is a no-op unless run config `faults` is set; netsim_mod unless link-profile='measured:<profile>'
# (a measured-link simulation: it plays the hidden links)
app = ClientApp(mods=[netsim_mod, faults_mod, make_compression_mod(initial_model=initial_model)])


def validate_node_config(node_config) -> tuple[int, int]:
    """(partition-id, num-partitions), checked; raises ValueError naming the key, the value and what is allowed.

    ``device``, when given, must name a torch device (``cpu``, ``cuda``, ``cuda:1``...).
    """
    cfg = dict(node_config)
    for key in ("partition-id", "num-partitions"):
        if key not in cfg:
            raise ValueError(f"node config lacks {key!r}; set it with flower-supernode --node-config "
                             f"'partition-id=0 num-partitions=10' (the simulation engine sets it)")
    parts, pid = cfg["num-partitions"], cfg["partition-id"]
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"node config num-partitions={parts!r} is invalid: num-partitions must be a positive integer")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < parts:
        raise ValueError(f"node config partition-id={pid!r} is invalid: partition-id must be an integer "
                         f"in [0, {parts}) (num-partitions={parts})")
    if "device" in cfg:
        device = cfg["device"]
        try:
            if not isinstance(device, str):
                raise TypeError
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"node config device={device!r} is invalid: device must be a torch device "
                             f"such as 'cpu', 'cuda' or 'cuda:1'") from None
    return pid, parts


def _model_and_data(msg: Message, context: Context):
    """The task's model holding the message's arrays, and this node's partition (x, y, partition id)."""
    cfg = context.run_config
    seed = int(cfg["seed"])
    task_name = str(cfg.get("task", "digits"))
    model = task.build_model(str(cfg["model"]), seed=seed, task=task_name)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    pid, parts = validate_node_config(context.node_config)
    x, y = task.load_partition(task_name, pid, parts, float(cfg["partition-alpha"]), seed)
    return model, x, y, pid


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation: the model it is sent (through ``compression_mod``: its tier's reference)
    on this node's partition."""
    model, x, y, _ = _model_and_data(msg, context)
    loss, accuracy = task.evaluate(model, x, y, device=node_device(context))
    return Message(
        RecordDict({"metrics": MetricRecord({"eval_loss": loss, "eval_accuracy": accuracy,
                                             "num-examples": int(len(y))})}),
        reply_to=msg,
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    seed = int(cfg["seed"])
    model, x, y, pid = _model_and_data(msg, context)
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
