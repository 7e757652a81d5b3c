"""A simulated network for measured-link runs: hidden links whose transfer times the server observes.

With run config ``link-profile='measured:<profile>'`` (``'measured:mixed'``, a preset or a table path),
``<profile>`` is the *hidden* truth: the server does not send it to the clients (``compression_mod`` never learns its
link; it budgets from what the server measured, :mod:`fedcomp.strategies.measured`), and
:func:`netsim_mod`, outermost on the project's ClientApp, plays the network: for each train
message it takes the node's link from the profile (:func:`fedcomp.links.resolve_link`, node-config
link keys first) and adds to the reply the seconds the broadcast and the reply take on it
(:meth:`fedcomp.links.Link.download_s`/``upload_s`` of the bytes as the server counts them), each
with a measurement error of :data:`TIMING_ERROR` (relative, Gaussian, seeded by run seed, round and
partition). The delay is virtual, as all simulated time in this project is: the server's observer
reads it where a deployment reads wall clocks, and removes the record before the reply is counted.
"""

from __future__ import annotations

import random

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedcomp import links
from fedcomp import protocol as P
from fedcomp.msgsize import message_bytes

TIMING_ERROR = 0.02  # relative standard deviation of an observed transfer time


def hidden_profile(run_config) -> str | None:
    """The simulated network's profile when the run asks for measured links over hidden ones, else None."""
    hidden = links.measured_profile(str(run_config.get("link-profile", links.NONE)))
    return None if hidden in (None, links.NONE) else hidden


def netsim_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: add the hidden link's transfer times to train replies (see the module docstring)."""
    cfg = context.run_config
    hidden = hidden_profile(cfg)
    if (hidden is None or not msg.has_content() or msg.metadata.message_type.split(".")[0] != "train"
            or P.DOWNLOAD_RECORD not in msg.content.config_records):
        return call_next(msg, context)
    seed = int(cfg.get("seed", 0))
    link = links.resolve_link(context.node_config, hidden, seed=seed)
    down_bytes = message_bytes(msg.content)
    server_round = int(msg.content.config_records[P.DOWNLOAD_RECORD][P.ROUND])
    reply = call_next(msg, context)
    if link is None or not reply.has_content():
        return reply
    up_bytes = message_bytes(reply.content)
    partition = int(context.node_config.get("partition-id", context.node_id))
    rng = random.Random(f"{seed}/{server_round}/{partition}/netsim")
    noise = [max(0.5, 1 + TIMING_ERROR * rng.gauss(0, 1)) for _ in range(2)]
    reply.content[links.NETSIM_RECORD] = ConfigRecord({
        "link": link.describe(), "down-s": link.download_s(down_bytes) * noise[0],
        "up-s": link.upload_s(up_bytes) * noise[1],
    })
    return reply
