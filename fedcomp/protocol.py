"""Record and config keys shared by the client mod and the strategy wrapper (one place, both sides).

No Flower import here: these are plain strings naming records inside a Flower ``RecordDict``.

Server -> client (train message)::

    DOWNLOAD_RECORD: ConfigRecord {MODE, PAYLOADS, ROUNDS, BASE_CRC, REF_CRC, TIER, TIERS, TIER_KBPS,
                                   LAYOUT, UPLOAD_SPEC, DOWNLOAD_SPEC (the tier's), ERROR_FEEDBACK,
                                   SEED, ROUND, ARRAYS_KEY, DELTA, DELTA_REF,
                                   LINK_PROFILE, DEADLINE, FALLBACK}
    <the strategy's ConfigRecord, unchanged>

Client -> server (train reply)::

    UPLOAD_RECORD: ConfigRecord {PAYLOAD, ARRAYS_KEY, DELTA_REF, TIER, REF_VERSION, REF_CRC, WANT_TIER}
                   or, when the broadcast could not be applied, {RESYNC, WANT_TIER} (no training);
                   a client with a link adds {SPEC, LINK, BUDGET, COMPUTE_S, DOWNLOAD_SEEN} (+ BUDGET_STATUS, BUDGET_REASON)
                   (and no PAYLOAD when its budget was too small and it skipped the round)
    <the ClientApp's MetricRecord (and any other non-array record), unchanged>
"""

DOWNLOAD_RECORD = "fedcomp.download"
UPLOAD_RECORD = "fedcomp.upload"
RESIDUAL_STATE = "fedcomp.residual"  # Context.state key of the client's error-feedback residual
CODEC_STATE = "fedcomp.codec-state"  # Context.state key of the codec's client state (warm starts, momentum)

PAYLOAD = "payload"  # bytes: a fedcomp wire-format payload (the upload)
LAYOUT = "layout"  # str: Layout.to_json() of the model
UPLOAD_SPEC = "upload"  # str: codec spec the client must use for its reply
DOWNLOAD_SPEC = "download"  # str: codec spec of the broadcast's chain steps (its tier's)
ERROR_FEEDBACK = "error-feedback"  # bool: keep a residual across rounds
SEED = "seed"  # int: run seed, part of every nonce
ROUND = "round"  # int: server round, part of every nonce
ARRAYS_KEY = "arrays-key"  # str: name of the ArrayRecord the payload stands for
DELTA = "delta"  # float beta: clients encode update - beta * (what they last sent); 0 = off
DELTA_REF = "delta-ref"  # int: round of the reference the delta is against (0: none); per node

LAST_SENT_STATE = "fedcomp.last-sent"  # Context.state: the update the server reconstructed last time
LAST_ROUND_STATE = "fedcomp.last-round"  # Context.state: ConfigRecord {"round": round of LAST_SENT_STATE}

# -- compressed broadcasts (fedcomp.broadcast): server -> client, in DOWNLOAD_RECORD --
MODE = "mode"  # str: "chain" (steps to apply to the held reference) or "full" (the reference itself)
PAYLOADS = "payloads"  # list[bytes]: the chain's steps in order, or the one full payload
ROUNDS = "rounds"  # list[int]: round of each step (full: the reference's version)
BASE_CRC = "base-crc"  # int: CRC32 the client's reference must have before the chain
REF_CRC = "ref-crc"  # int: CRC32 of the reference after applying (also reported back by the client)
TIER = "tier"  # int: the download tier of this broadcast (also reported back)
TIERS = "tiers"  # int: number of download tiers
TIER_KBPS = "tier-kbps"  # str: comma-separated downlink kbps thresholds between tiers ("" : none)
SEEDED_INIT = "seeded-init"  # bool: a chain may start at the round-0 model every node builds from the run's
#   seed (CRC-checked; a mod that cannot build it asks for a resync); absent or False: today's protocol

# -- client -> server, in UPLOAD_RECORD --
REF_VERSION = "ref-version"  # int: round of the reference the client holds after this broadcast
WANT_TIER = "want-tier"  # int: the tier the client should be in (from its node config / link)
RESYNC = "resync"  # str: why the client could not rebuild the reference (no payload then)

REF_STATE = "fedcomp.reference"  # Context.state: the broadcast reference model the client holds
REF_INFO_STATE = "fedcomp.reference-info"  # Context.state: ConfigRecord {TIER, REF_VERSION, REF_CRC}

# -- bandwidth budgets (fedcomp.links, fedcomp.budget): server -> client, in DOWNLOAD_RECORD --
LINK_PROFILE = "link-profile"  # str: run config link-profile ('none', a preset, 'mixed', a table path)
DEADLINE = "round-deadline-s"  # float: the run's round deadline in seconds (0: none)
FALLBACK = "budget-fallback"  # str: "skip" or "coarsest" when even the coarsest setting is over budget

# -- client -> server, in UPLOAD_RECORD (clients with a link only) --
SPEC = "spec"  # str: the concrete codec spec of the payload (the budget picked its free parameter)
LINK = "link"  # str: the client's link as node-config text ("uplink-kbps=... downlink-kbps=... ...")
BUDGET = "budget"  # int: whole-reply bytes allowed this round (-1: no budget)
BUDGET_STATUS = "budget-status"  # str: too-small-skipped or too-small-coarsest (absent: the upload fits)
BUDGET_REASON = "budget-reason"  # str: why the budget was too small (with BUDGET_STATUS only)
COMPUTE_S = "compute-s"  # float: measured seconds of decode + training + encode this round
DOWNLOAD_SEEN = "download-bytes"  # int: bytes of the broadcast as the client counted them
ENCODE_STATE = "fedcomp.encode-seconds"  # Context.state: ConfigRecord {"s": recent encode seconds}
ENCODE_BYTES_STATE = "fedcomp.encode-bytes"  # Context.state: ConfigRecord {"s": the payload bytes those encodes made}

# -- nothing lost: the server acknowledges aggregated replies; the client re-adds the rest --
ACK_ROUND = "ack-round"  # int (server -> client): round of this node's last reply that reached the aggregate
PENDING_STATE = "fedcomp.pending"  # Context.state: the update the client sent last (as the server decodes it)
PENDING_INFO_STATE = "fedcomp.pending-info"  # Context.state: ConfigRecord {"round": round it was sent in}

# -- payloads bound to their round (client -> server, in UPLOAD_RECORD) --
REPLY_ROUND = "reply-round"  # int: the ROUND of the broadcast this reply answers; the server drops a mismatch

# -- federated evaluation through the broadcast protocol --
# A client whose train replies list EVALUATE_CAPABILITY in CAPABILITIES gets its evaluate messages
# like train messages: the strategy's records plus DOWNLOAD_RECORD {MODE, PAYLOADS, ROUNDS, BASE_CRC,
# REF_CRC, TIER, TIERS, TIER_KBPS, LAYOUT, DOWNLOAD_SPEC, SEED, ROUND, ARRAYS_KEY, KIND="evaluate"}
# and no ArrayRecord; it applies the plan (storing the reference as for training), puts the reference
# under ARRAYS_KEY, calls the app, and returns the app's reply with UPLOAD_RECORD {TIER, REF_VERSION,
# REF_CRC, WANT_TIER} added (no PAYLOAD); {RESYNC, WANT_TIER} alone when the plan cannot be applied
# (the app is not called). Other clients get the dense model, counted in the same byte totals.
CAPABILITIES = "capabilities"  # list[str] (client -> server, in UPLOAD_RECORD of train replies)
EVALUATE_CAPABILITY = "evaluate"  # the client's mod handles evaluate broadcasts as described above
KIND = "kind"  # str (server -> client, in DOWNLOAD_RECORD): "train" (absent) or "evaluate"
