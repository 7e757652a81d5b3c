"""``compression_mod``: a Flower client mod that decodes compressed broadcasts and compresses replies.

It works with any ClientApp whose train reply carries one ArrayRecord (the trained model):

1. The broadcast moves the reference model kept in the node's state (a chain of compressed
   steps, or the full reference: :mod:`fedcomp.broadcast`); the reference is handed to the app
   as the ArrayRecord it expects (under the strategy's original record name). If the
   reference cannot be rebuilt exactly (state lost, CRC mismatch) the mod replies with a
   resync request instead of training, and the server sends the full model next time.
2. The app trains and replies with its model.
3. The mod computes the update ``delta = trained - received``, adds the residual kept in
   the node's state (error feedback), encodes it with the codec the server asked for, keeps
   the new residual, and replaces the reply's ArrayRecord with the payload, the reference it
   holds (tier, version, CRC) and the tier it wants.

Bandwidth budgets (:mod:`fedcomp.clients.budgeting`): when the node has a link (node config
``uplink-kbps``/``downlink-kbps``/... or ``link=<preset>``, else the run's ``link-profile`` for its
``partition-id``), its downlink picks the download tier, step 3 encodes with the codec whose free
parameter makes the whole reply fit the link's budget (byte cap, or what the uplink carries in the
time the round deadline leaves), and the reply reports the concrete spec, link, budget, status,
the broadcast bytes it received and the measured seconds of decode + training + encode. The
encode's own time is not known before the fit: the budget reserves the longest of the node's
recent encodes (x1.5). A node that declares no link budgets from the link the server measured for
it, when the broadcast carries one (:data:`fedcomp.links.ESTIMATE`, sent by
:class:`fedcomp.strategies.measured.MeasuredLinkStrategy`); its reply then also reports the wall time
at which the broadcast reached it (``received-at``), from which the server times both transfers,
and, on Linux, when its process started (``process-started-at``: where the time went). Without
a link (profile 'none', no link keys, no estimate) nothing of this happens.

Messages without a fedcomp record (evaluation, or a strategy that is not wrapped) pass through;
a *train* message without one means the strategy is not wrapped in ``CompressedStrategy``, and
the node logs one warning saying so (once per node: the flag lives in its state).

What the mod keeps per node is one declared class, :class:`fedcomp.clients.state.ClientState`,
loaded once and saved once per message: in ``Context.state`` in a simulation, in a file per node
in a deployment (written before the reply leaves; see :mod:`fedcomp.clients.state`). A broadcast
it cannot read, a node config it cannot use or a train reply it cannot compress gets an error
reply (Flower's convention for mods: ``Message(Error(code, reason), reply_to=msg)``) whose reason
says how to fix it; the server's strategy records it as that client's failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from logging import WARNING
from time import perf_counter, time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

import fedcomp
from fedcomp import links
from fedcomp import protocol as P
from fedcomp.adapt import FAST_KBPS
from fedcomp.base import add_residual
from fedcomp.broadcast import ResyncNeeded, apply_plan, model_step, parse_thresholds, reference_crc, tier_for_kbps
from fedcomp.clients.budgeting import budgeted_upload, encode_reserve
from fedcomp.msgsize import message_bytes
from fedcomp.clients.state import ClientState
from fedcomp.wire import REPLY_TAG, REPLY_TOKEN, TOKEN_BITS, arena, output_like, reply_tag

ENCODE_HISTORY = 5  # recent encodes kept (seconds, payload bytes): the budget's encode reserve (budgeting.encode_reserve)
UNWRAPPED_WARNING = (
    "fedcomp: this node has compression_mod but received a train message without fedcomp's record: the "
    "server's strategy is not wrapped in CompressedStrategy, so nothing is compressed. Wrap it: "
    "strategy = CompressedStrategy(FedAvg(...), upload='topk(ratio=0.01)+qsgd(bits=4)') (this warning is "
    "logged once per node)"
)


def process_started_at() -> float | None:
    """When this process started, in Unix seconds: ``/proc/self/stat``'s start time (clock ticks
    since boot) against ``/proc/uptime``; None where /proc is not there (not Linux) or unreadable.

    Reported next to ``received-at`` (:data:`fedcomp.links.STARTED_AT`): in a deployment, where a
    process serves one message, the server splits the measured download at it into Flower's polls
    (before) and the process's start-up and imports (after). Not the download's end: Flower 1.39
    starts the process before the message's arrays are pulled. Resolution: one clock tick (10 ms)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # the command name (field 2) may hold spaces: count fields after its closing parenthesis
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
        return time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class ModError(fedcomp.FedcompError):
    """What compression_mod cannot work with; it becomes the reason of an error reply."""


def node_device(context: Context) -> torch.device:
    """The node's device: node config ``device`` if given, else CUDA when present, else CPU.

    Raises :class:`ModError` for a ``device`` torch does not know."""
    wanted = str(context.node_config.get("device", "cuda" if torch.cuda.is_available() else "cpu"))
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        return torch.device(wanted)
    except RuntimeError:
        raise ModError(f"node config device={wanted!r} is invalid: set it to a torch device such as 'cpu', "
                       f"'cuda' or 'cuda:1', or remove it") from None


def desired_tier(context: Context, tiers: int, thresholds: str, link: links.Link | None = None) -> int:
    """The download tier this node belongs in: node config ``download-tier``, else its downlink
    kbps (node config ``downlink-kbps``, else its ``link``'s) against the server's thresholds,
    else ``partition-id`` modulo the number of tiers (simulated nodes know nothing else), else 0.

    Raises :class:`ModError` for a ``download-tier`` outside the server's tiers."""
    config = context.node_config
    if "download-tier" in config:
        tier = config["download-tier"]
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < tiers:
            raise ModError(f"node config download-tier={tier!r} is invalid: the server has {tiers} download "
                           f"tier(s); set it to an integer in [0, {tiers - 1}] or remove it")
        return tier
    limits = parse_thresholds(thresholds, tiers) if thresholds else ()
    if limits and "downlink-kbps" in config:
        return tier_for_kbps(float(config["downlink-kbps"]), limits)
    if limits and link is not None:
        return tier_for_kbps(link.downlink_kbps, limits)
    if "partition-id" in config:
        return int(config["partition-id"]) % tiers
    return 0


def node_link(context: Context, cfg) -> links.Link | None:
    """This node's link: node-config link keys first (``uplink-kbps`` or ``link=<preset>``; a
    ``downlink-kbps`` alone only picks the download tier), else the run's link profile (sent in
    the broadcast) for its partition; the run's round deadline where the link has none. None: no link.

    Raises :class:`ModError` when the keys do not describe a link."""
    profile = str(cfg.get(P.LINK_PROFILE, links.NONE))
    config = context.node_config
    if "link" not in config and "uplink-kbps" not in config:
        # downlink-kbps alone only picks the download tier (no uplink: no link, no budget)
        config = {k: v for k, v in config.items() if k not in ("downlink-kbps", "latency-ms")}
    try:
        link = links.resolve_link(config, profile, seed=int(cfg[P.SEED]))
    except links.LinkError as exc:
        raise ModError(f"fedcomp could not resolve this node's link (node config link keys, or the run "
                       f"config's link-profile): {exc}") from exc
    if link is None:
        return None
    deadline = float(cfg.get(P.DEADLINE, 0.0))
    return links.with_deadline(link, deadline if deadline > 0 else None)


def estimated_link(cfg) -> links.Link | None:
    """The link the server measured for this node (:data:`fedcomp.links.ESTIMATE` in the broadcast,
    sent by :class:`fedcomp.strategies.measured.MeasuredLinkStrategy`), as sent; None when the server
    sent none. Used only when the node declares no link. The server states the deadline in it, except
    while it probes a node its estimate puts past the deadline (slow start: the byte cap alone budgets,
    :meth:`fedcomp.adapt.MeasuredBudgets.link`), so the run's deadline is not filled in.

    Raises :class:`ModError` when the text does not describe a link."""
    text = cfg.get(links.ESTIMATE)
    if not text:
        return None
    try:
        link = links.link_from_mapping(dict(kv.split("=", 1) for kv in str(text).split()), "the server's estimate")
    except (links.LinkError, ValueError) as exc:
        raise ModError(f"fedcomp could not read the link the server estimated for this node ({text!r}): {exc}; "
                       f"the server and this client must run the same fedcomp version") from exc
    return link


InitialModel = Callable[[Context], Mapping[str, torch.Tensor]]


def make_compression_mod(initial_model: InitialModel | None = None):
    """A :func:`compression_mod` that can start from the run's seeded round-0 model.

    ``initial_model(context)`` returns the model every node builds from the run's seed, the one
    the server starts from (the project's ClientApp: ``task.build_model(model, seed).state_dict()``).
    When the server's broadcast says ``seeded-init`` and this node holds no reference (first
    contact, or one the chain does not start from), the mod takes that model as the chain's base
    instead of needing the dense model: first contact costs the chain of compressed steps since
    round 0. Its CRC is checked against the chain's base; a mismatch (another torch version
    initialises differently) is a resync request, and the server sends the full model next round.
    Without ``initial_model`` it is :func:`compression_mod` (a seeded chain to a node without a
    reference is a resync request; the server then sends the full model).
    """
    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not msg.has_content() or P.DOWNLOAD_RECORD not in msg.content.config_records:
            if msg.metadata.message_type.split(".")[0] == MessageType.TRAIN:
                _warn_unwrapped(context)
            return call_next(msg, context)
        try:
            state = ClientState.load(context)
        except ValueError as exc:  # a node config the state cannot be kept under
            return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, str(exc)), reply_to=msg)
        try:
            return _round(msg, context, call_next, state, initial_model)
        except ModError as exc:
            return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, str(exc)), reply_to=msg)
        finally:  # also when the ClientApp raised: the reference it was handed is this node's now
            state.save(context)

    mod.__name__ = mod.__qualname__ = "compression_mod" if initial_model is None else "seeded_compression_mod"
    mod.__doc__ = compression_mod.__doc__
    return mod


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod for a ClientApp under :class:`fedcomp.strategies.CompressedStrategy`.

    On a train message with a fedcomp download record it rebuilds the model from the broadcast
    and the reference the node keeps (``Context.state``, or its state file in a deployment), hands
    it to the app under the record name the strategy used, and replaces the app's reply model by
    the compressed update (error feedback kept beside the reference). A reference it cannot
    rebuild gets a resync request (the server sends the full model next round); a broadcast or
    reply it cannot handle, an error reply saying how to fix it. Messages without the record pass through. For a seeded cross-device
    start use :func:`make_compression_mod` with ``initial_model``.
    """
    return _PLAIN(msg, context, call_next)


def _held_for(state: ClientState, plan: dict, cfg, context: Context, initial_model: InitialModel | None):
    """The reference and its (tier, version, CRC) the plan is applied to: the one held, or the
    seeded round-0 model where the server's chain starts there and the held one does not fit."""
    held, info = state.reference, state.reference_info
    if (initial_model is None or not cfg.get(P.SEEDED_INIT, False) or plan["mode"] != "chain"
            or (info is not None and info[2] == plan["base_crc"])):
        return held, info
    if info is not None and info[0] == plan["tier"] and info[1] in plan["rounds"]:
        return held, info  # part of the chain applied already (apply_plan skips it)
    try:
        initial = {k: v.detach().cpu() for k, v in initial_model(context).items()}
    except Exception as exc:  # the user's builder: a resync (full model next round), not a crash
        raise ResyncNeeded(f"initial_model failed ({type(exc).__name__}: {exc})") from exc
    return initial, (plan["tier"], 0, reference_crc(initial))


def _warn_unwrapped(context: Context) -> None:
    try:
        state = ClientState.load(context)
    except ValueError as exc:  # a node config the state cannot be kept under: warn every time, pass through
        log(WARNING, "%s (%s)", UNWRAPPED_WARNING, exc)
        return
    if not state.warned_unwrapped:
        log(WARNING, UNWRAPPED_WARNING)
        state.warned_unwrapped = True
        state.save(context)


def _broadcast(cfg, evaluate: bool = False) -> tuple[fedcomp.Layout, fedcomp.Codec | None, dict]:
    """The broadcast's layout, upload codec (None for an evaluate broadcast) and plan arguments;
    ModError when it is unreadable (every key the mod reads later is checked here too)."""
    try:
        layout = fedcomp.Layout.from_json(str(cfg[P.LAYOUT]))
        upload = None if evaluate else fedcomp.build_codec(str(cfg[P.UPLOAD_SPEC]))
        plan = dict(mode=str(cfg[P.MODE]), tier=int(cfg[P.TIER]), spec=str(cfg[P.DOWNLOAD_SPEC]),
                    payloads=[bytes(p) for p in cfg[P.PAYLOADS]], rounds=[int(r) for r in cfg[P.ROUNDS]],
                    base_crc=int(cfg[P.BASE_CRC]), crc=int(cfg[P.REF_CRC]), layout=layout)
        number = (int, float)
        for key, kind, required in ((P.TIERS, int, True), (P.SEED, int, True), (P.ROUND, int, True),
                                    (P.ARRAYS_KEY, str, True), (P.ERROR_FEEDBACK, bool, not evaluate),
                                    (P.TIER_KBPS, str, True),
                                    (P.DELTA, number, False), (P.DELTA_REF, int, False), (P.ACK_ROUND, int, False),
                                    (P.LINK_PROFILE, str, False), (P.DEADLINE, number, False), (P.FALLBACK, str, False),
                                    (links.ESTIMATE, str, False), (REPLY_TOKEN, int, False)):
            if (required or key in cfg) and not isinstance(cfg[key], kind):
                raise TypeError(f"{key}={cfg[key]!r} is not of the type fedcomp sends")
        if REPLY_TOKEN in cfg and not 0 <= cfg[REPLY_TOKEN] < 1 << TOKEN_BITS:
            raise ValueError(f"{REPLY_TOKEN}={cfg[REPLY_TOKEN]} is not a token this server issues")
        if cfg[P.TIERS] < 1:
            raise ValueError(f"{P.TIERS}={cfg[P.TIERS]} is not a positive number of tiers")
        if cfg[P.TIER_KBPS]:
            parse_thresholds(cfg[P.TIER_KBPS], cfg[P.TIERS])
        return layout, upload, plan
    except fedcomp.FedcompError as exc:
        raise ModError(f"fedcomp could not read the server's broadcast: {exc}. The server and this client "
                       f"must run the same fedcomp version; reinstall it on both") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ModError(f"fedcomp's broadcast record is malformed ({type(exc).__name__}: {exc}); the server and "
                       f"this client must run the same fedcomp version; reinstall it on both") from exc


def _round(msg: Message, context: Context, call_next: ClientAppCallable, state: ClientState,
           initial_model: InitialModel | None = None) -> Message:
    start = perf_counter()  # compute time: decode + training + encode (what the client does)
    cfg = msg.content.config_records[P.DOWNLOAD_RECORD]
    if cfg.get(P.KIND) == "evaluate":
        return _evaluate(msg, context, call_next, state, cfg)
    layout, upload, plan = _broadcast(cfg)
    link = node_link(context, cfg)
    estimated = link is None and links.ESTIMATE in cfg
    if estimated:  # no declared link: the one the server measured (wall clock: the server splits its round trip)
        received_at = time()
        link = estimated_link(cfg)
    download_seen = message_bytes(msg.content) if link is not None else 0
    try:
        if estimated and link.downlink_kbps >= FAST_KBPS and "download-tier" not in context.node_config:
            want = 0  # downlink not measured yet: the most compressed tier (conservative start)
        else:
            want = desired_tier(context, int(cfg[P.TIERS]), str(cfg[P.TIER_KBPS]), link)
    except (fedcomp.SpecError, TypeError, ValueError) as exc:  # ModError passes: it is not among them
        raise ModError(f"fedcomp could not place this node in a download tier: {exc}; check the node config's "
                       f"download-tier, downlink-kbps and partition-id") from exc
    seeded = False
    held_info = state.reference_info  # for the resync's reason
    try:
        base, base_info = _held_for(state, plan, cfg, context, initial_model)
        seeded = base is not state.reference  # started from the seeded round-0 model
        received, info = apply_plan(base, base_info, **plan)
    except fedcomp.FedcompError as exc:  # ResyncNeeded, or a step that does not decode
        state.reference, state.reference_info = None, None
        reason = str(exc) if isinstance(exc, ResyncNeeded) else f"broadcast did not decode: {exc}"
        if seeded and isinstance(exc, ResyncNeeded) and "chain's base" in reason:
            if held_info is not None:  # it held a reference, another than the chain's base: a step it missed
                reason += (f". This node held tier {held_info[0]} round {held_info[1]} (CRC 0x{held_info[2]:08x}), "
                           f"not the chain's base: its state missed a broadcast (or did not persist between rounds)")
            elif plan["rounds"] and min(plan["rounds"]) == 1:  # the chain starts at round 0: the seeded model
                reason += (". This node's seeded round-0 model is not the server's initial model: the ServerApp's "
                           "initial_arrays must be the model initial_model builds from the same seed (seeded_init)")
            else:
                reason += ". This node held no reference (its state was empty) and the chain does not start at round 0"
        record = {P.RESYNC: reason, P.WANT_TIER: want}
        if link is not None:  # no training, but the round still cost this node its download
            record.update({P.LINK: link.describe(), P.BUDGET: -1, P.DOWNLOAD_SEEN: download_seen,
                           P.COMPUTE_S: float(perf_counter() - start)})
            if estimated:
                record.update(_arrival(received_at, msg, context))
        return Message(RecordDict({P.UPLOAD_RECORD: ConfigRecord(record)}), reply_to=msg)
    state.reference, state.reference_info = received, info
    # the first reply after a full reference (or a chain from the seeded round-0 model) says what
    # this mod can do (evaluate broadcasts); a server that restarted sends one again and so learns it again
    capabilities = {P.CAPABILITIES: [P.EVALUATE_CAPABILITY]} if plan["mode"] == "full" or seeded else {}

    arrays_key = str(cfg[P.ARRAYS_KEY])
    inner = RecordDict({k: v for k, v in msg.content.items() if k != P.DOWNLOAD_RECORD})
    inner[arrays_key] = ArrayRecord(received)
    msg.content = inner
    reply = call_next(msg, context)
    if reply.has_error():
        return reply

    array_keys = list(reply.content.array_records)
    if len(array_keys) != 1:
        raise ModError(f"compression_mod needs a train reply with exactly one ArrayRecord (the trained model), "
                       f"got {len(array_keys)}: {array_keys}; return the model as one ArrayRecord and metrics "
                       f"in a MetricRecord")
    trained = dict(reply.content.array_records[array_keys[0]].to_torch_state_dict())
    try:
        layout.check(trained)
    except fedcomp.SpecError as exc:  # a client with another model: say so instead of a shape error
        raise ModError(f"fedcomp: the trained model does not match the server's layout: {exc}; the ClientApp "
                       f"must train and return the model the server sent (same names, shapes and dtypes)") from exc
    device = node_device(context)
    delta = {}
    # the fp32 ones into one fresh allocation in huge pages where large (wire.arena; a ResNet-50
    # layout's 161 tensors each in its own buffer took 8.2-11.4 read passes of the update, 3.3-4.9 so)
    with arena.fp32(trained[name].numel() for name in layout.names if trained[name].dtype == torch.float32):
        for name in layout.names:
            t = trained[name].to(device)
            delta[name] = model_step(t, received[name].to(device), out=output_like(t))

    use_ef = bool(cfg[P.ERROR_FEEDBACK])
    residual = _return_unacknowledged(state, cfg, state.residual if use_ef else None, use_ef)
    # delta coding: encode update - beta * (what the server reconstructed from our last reply),
    # only when the server holds that same reference (else send the plain update: a resync)
    beta = float(cfg.get(P.DELTA, 0.0))
    ref = 0
    last_sent: dict[str, torch.Tensor] = {}
    if beta > 0 and state.last_sent is not None and state.last_round is not None:
        if state.last_round != 0 and state.last_round == int(cfg.get(P.DELTA_REF, 0)):
            ref = state.last_round
            last_sent = {k: v.to(device) for k, v in state.last_sent.items()}
            delta = {k: v - beta * last_sent[k] if k in last_sent else v for k, v in delta.items()}
    codec_state = {k: v.to(device) for k, v in state.codec_state.items()}
    server_round = int(cfg[P.ROUND])
    # the partition id where the node has one: node ids are random per simulation run, and the
    # nonce (stochastic rounding, random-k) must not be, for seeded runs to repeat bit for bit
    ident = int(context.node_config.get("partition-id", context.node_id))
    nonce = fedcomp.derive_nonce(int(cfg[P.SEED]), server_round, ident)
    rest = RecordDict({k: v for k, v in reply.content.items() if k != array_keys[0]})
    record = {P.ARRAYS_KEY: array_keys[0], P.DELTA_REF: ref, P.TIER: info[0], P.REF_VERSION: info[1],
              P.REF_CRC: info[2], P.WANT_TIER: want, **capabilities}
    if estimated:
        record.update(_arrival(received_at, msg, context))
    if link is not None:
        reply.content = _budgeted_reply(
            state, cfg, upload.spec, link, delta, residual, codec_state, rest, record, nonce=nonce,
            server_round=server_round, use_ef=use_ef, beta=beta, last_sent=last_sent,
            download_seen=download_seen, start=start)
        return reply
    with _encoding(upload.spec, layout):
        encoded, new_residual = fedcomp.compress(
            upload, delta, residual, nonce=nonce, error_feedback=use_ef, round=server_round, state=codec_state
        )
    _remember(state, cfg, encoded, new_residual, codec_state, server_round, use_ef, beta, last_sent)
    rest[P.UPLOAD_RECORD] = ConfigRecord({P.PAYLOAD: encoded.payload, **record, **_tagged(cfg, encoded.payload)})
    reply.content = rest
    return reply


def _arrival(received_at: float, msg: Message, context: Context) -> dict:
    """The reply's record of when the broadcast arrived: ``received-at``, on Linux the process
    start, and in a deployment the link timings the node's SuperNode recorded (:func:`_link_timings`)."""
    started = process_started_at()
    return {links.RECEIVED_AT: float(received_at), **({} if started is None else {links.STARTED_AT: started}),
            **_link_timings(msg, context)}


def _link_timings(msg: Message, context: Context) -> dict:
    """What this node's SuperNode timed on its link (``fedcomp.clients.supernode``): this broadcast's
    pull, and its last reply's push; nothing under a plain ``flower-supernode`` or in a simulation."""
    from fedcomp.clients.state import _deployed_for
    from fedcomp.clients.supernode import read_link_file

    if not _deployed_for(context):
        return {}
    seen, out = read_link_file(context.node_id), {}
    try:
        down, up = seen.get("down"), seen.get("up")
        if down is not None and down.get("message") == msg.metadata.message_id:
            out.update({links.LINK_DOWN_BYTES: int(down["bytes"]), links.LINK_DOWN_S: float(down["seconds"])})
            if down.get("wire_s") is not None:
                out[links.LINK_DOWN_WIRE_S] = float(down["wire_s"])
        if up is not None:
            out.update({links.LINK_UP_OF: str(up["message"]), links.LINK_UP_BYTES: int(up["bytes"]),
                        links.LINK_UP_S: float(up["seconds"])})
            if up.get("wire_s") is not None:
                out[links.LINK_UP_WIRE_S] = float(up["wire_s"])
    except (KeyError, TypeError, ValueError):  # a file from another version: the server's own clocks time the node
        return {}
    return out


class _encoding:
    """Context of an encode: an unexpected exception in it (a codec bug, not the user's code)
    becomes a :class:`ModError` naming the codec spec and the tensors being encoded where the
    traceback shows them (a segment's names, a tensor name), else the layout's tensors and sizes,
    so the server records the client's failure and the reason instead of a raw traceback.
    ``passes``: exception types left to the caller."""

    def __init__(self, spec: str, layout: fedcomp.Layout, passes: tuple[type[BaseException], ...] = ()) -> None:
        self.spec, self.layout, self.passes = spec, layout, passes

    def __enter__(self) -> "_encoding":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, (ModError, *self.passes)):
            return False
        raise ModError(f"fedcomp could not encode this reply with upload codec {self.spec!r} "
                       f"({type(exc).__name__}: {exc}) {encode_context(exc, self.layout)}; this is a bug in "
                       f"fedcomp's codec, please report it with this message (the round goes on without this "
                       f"node's update)") from exc


def encode_context(exc: BaseException, layout: fedcomp.Layout | None, limit: int = 8) -> str:
    """Which tensors an encode was at when ``exc`` was raised: the innermost frame of the traceback
    holding a segment (``.names``) or a tensor ``name`` of the layout; else the layout's tensors
    (name and size, the first ``limit``)."""
    names = set(layout.names) if layout is not None else set()
    found = None
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # past the caller's own frame
    while tb is not None:  # outermost to innermost: the last match is the innermost
        local = tb.tb_frame.f_locals
        for key in ("seg", "segment"):
            seg = local.get(key)
            seg_names = getattr(seg, "names", None)
            if isinstance(seg_names, tuple) and seg_names and all(isinstance(n, str) for n in seg_names):
                sizes = getattr(seg, "numel", None)
                found = (f"in the segment of tensor(s) {list(seg_names)[:limit]}"
                         + (f" ({sizes} elements)" if isinstance(sizes, int) else ""))
        name = local.get("name")
        if isinstance(name, str) and name in names:
            spec = next(t for t in layout.tensors if t.name == name)
            found = f"in tensor {name!r} (shape {list(spec.shape)}, {spec.numel} elements)"
        tb = tb.tb_next
    if found is not None:
        return found
    if layout is None:
        return "(tensors unknown)"
    listed = ", ".join(f"{t.name!r} ({t.numel})" for t in layout.tensors[:limit])
    more = len(layout.tensors) - limit
    return f"encoding tensors {listed}{f' and {more} more' if more > 0 else ''}"


def _evaluate(msg: Message, context: Context, call_next: ClientAppCallable, state: ClientState, cfg) -> Message:
    """An evaluate broadcast of a wrapped strategy: move the reference as for training, let the app
    evaluate it, and tell the server which reference this node holds now (no payload)."""
    _, _, plan = _broadcast(cfg, evaluate=True)
    try:
        want = desired_tier(context, int(cfg[P.TIERS]), str(cfg[P.TIER_KBPS]), node_link(context, cfg))
    except (fedcomp.SpecError, TypeError, ValueError) as exc:
        raise ModError(f"fedcomp could not place this node in a download tier: {exc}; check the node config's "
                       f"download-tier, downlink-kbps and partition-id") from exc
    try:
        received, info = apply_plan(state.reference, state.reference_info, **plan)
    except fedcomp.FedcompError as exc:
        state.reference, state.reference_info = None, None
        reason = str(exc) if isinstance(exc, ResyncNeeded) else f"broadcast did not decode: {exc}"
        return Message(RecordDict({P.UPLOAD_RECORD: ConfigRecord({P.RESYNC: reason, P.WANT_TIER: want})}),
                       reply_to=msg)
    state.reference, state.reference_info = received, info
    inner = RecordDict({k: v for k, v in msg.content.items() if k != P.DOWNLOAD_RECORD})
    inner[str(cfg[P.ARRAYS_KEY])] = ArrayRecord(received)
    msg.content = inner
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    reply.content[P.UPLOAD_RECORD] = ConfigRecord({P.TIER: info[0], P.REF_VERSION: info[1], P.REF_CRC: info[2],
                                                   P.WANT_TIER: want})
    return reply


def _tagged(cfg, payload: bytes) -> dict:
    """``{REPLY_TAG: tag}`` binding the payload to the token the server sent with this message
    (:func:`fedcomp.wire.reply_tag`); nothing for a server that sent none (older fedcomp)."""
    token = cfg.get(REPLY_TOKEN)
    return {} if token is None else {REPLY_TAG: reply_tag(payload, token)}


def _return_unacknowledged(state: ClientState, cfg, residual, use_ef: bool):
    """Nothing lost: if the update sent last time never reached the aggregate (dropped as
    corrupt, late, or its reply lost), the server's ack says so and it goes back into the
    residual, to be sent again. An acknowledged one is simply forgotten."""
    if state.pending_round is None:
        return residual
    sent_round, pending = state.pending_round, state.pending or {}
    state.pending, state.pending_round = None, None
    ack = int(cfg.get(P.ACK_ROUND, sent_round))  # a server that does not ack: assume it arrived
    if ack >= sent_round or not use_ef:
        return residual
    # re-added where the residual has the same shape (the residual's precision: fp32 at least)
    return {**(residual or {}), **add_residual(pending, residual or {}, promote=True)}


def _remember(state: ClientState, cfg, encoded, new_residual, codec_state, server_round: int, use_ef: bool,
              beta: float, last_sent) -> None:
    """After an encode: the new residual and codec state; what the server will reconstruct (delta
    coding); and, until the server acknowledges it, the update itself (error feedback on, no delta
    coding: with delta coding a dropped reply already restarts the reference)."""
    if use_ef and new_residual:
        state.residual = new_residual
    if codec_state:
        state.codec_state = codec_state
    if encoded is None:
        return
    if beta > 0:
        state.last_sent = {k: v + beta * last_sent[k] if k in last_sent else v
                           for k, v in encoded.decoded.items() if v.is_floating_point()}
        state.last_round = server_round
    if use_ef and new_residual and beta <= 0 and P.ACK_ROUND in cfg:
        state.pending = {k: v for k, v in encoded.decoded.items() if v.is_floating_point()}
        state.pending_round = server_round


def _budgeted_reply(state, cfg, spec, link, delta, residual, codec_state, rest, record, *, nonce, server_round,
                    use_ef, beta, last_sent, download_seen, start) -> RecordDict:
    """Step 3 for a node with a link: the reply whose whole size fits the link's budget."""
    encode_start = perf_counter()
    compute_s = encode_start - start  # decode + training
    history, sizes = list(state.encode_seconds), [int(b) for b in state.encode_bytes]
    # this round's encode time is not known yet: reserve 1.5x what recent ones predict at the budget
    # (first round: as long as decode + training took) so the encode does not push the node past its deadline
    reserve = encode_reserve(link, download_seen, compute_s, history, sizes)

    def build(payload: bytes, used: str) -> RecordDict:
        content = RecordDict(dict(rest.items()))
        # COMPUTE_S is a float (fixed 8 bytes on the wire): overwritten below at the same size
        content[P.UPLOAD_RECORD] = ConfigRecord({
            P.PAYLOAD: payload, **record, P.SPEC: used, P.LINK: link.describe(), P.BUDGET: budget_value,
            P.COMPUTE_S: 0.0, P.DOWNLOAD_SEEN: download_seen, **_tagged(cfg, payload),
        })
        return content

    budget = links.upload_budget(link, download_seen, compute_s + reserve)
    budget_value = -1 if budget is None else int(budget)
    try:
        with _encoding(spec, fedcomp.Layout.of(delta), passes=(fedcomp.SpecError,)):
            result = budgeted_upload(
                spec, delta, residual, link=link, download_bytes=download_seen, compute_s=compute_s + reserve,
                build=build, nonce=nonce, round=server_round, state=codec_state, error_feedback=use_ef,
                fallback=str(cfg.get(P.FALLBACK, "skip")),
            )
    except fedcomp.SpecError as exc:  # a codec without a free parameter, a bad fallback
        raise ModError(f"fedcomp could not fit the upload to this node's byte budget: {exc}; use an upload "
                       f"codec with a budget knob (e.g. topk, kbit, powersgd) or remove the node's link") from exc
    _remember(state, cfg, result.encoded, result.residual if use_ef else {}, result.state or {}, server_round,
              use_ef, beta, last_sent)
    encode_s = perf_counter() - encode_start  # the fit's search included: the client pays for it
    state.encode_seconds = (history + [encode_s])[-ENCODE_HISTORY:]
    made = len(result.encoded.payload) if result.encoded is not None and result.content is not None else 0
    state.encode_bytes = ([float(b) for b in sizes] + [float(made)])[-ENCODE_HISTORY:]
    if result.content is None:  # skipped: no payload, the update stays in the residual
        content = RecordDict(dict(rest.items()))
        content[P.UPLOAD_RECORD] = ConfigRecord({
            **record, P.SPEC: result.spec, P.LINK: link.describe(), P.BUDGET: budget_value,
            P.BUDGET_STATUS: result.status, P.BUDGET_REASON: str(result.info.get("reason", "")),
            P.COMPUTE_S: 0.0, P.DOWNLOAD_SEEN: download_seen,
        })
    else:
        content = result.content
        if result.status == "too-small-coarsest":  # over budget anyway: say so (fits report nothing extra)
            content[P.UPLOAD_RECORD][P.BUDGET_STATUS] = result.status
            content[P.UPLOAD_RECORD][P.BUDGET_REASON] = str(result.info.get("reason", ""))
    content[P.UPLOAD_RECORD][P.COMPUTE_S] = float(compute_s + encode_s)
    return content


_PLAIN = make_compression_mod()  # compression_mod itself: no seeded round-0 model
