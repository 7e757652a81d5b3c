"""Record and config keys shared by the client mod and the strategy wrapper (one place, both sides).

No Flower import here: these are plain strings naming records inside a Flower ``RecordDict``.

Server -> client (train message)::

    DOWNLOAD_RECORD: ConfigRecord {PAYLOAD, LAYOUT, UPLOAD_SPEC, DOWNLOAD_SPEC,
                                   ERROR_FEEDBACK, SEED, ROUND, ARRAYS_KEY, DELTA, DELTA_REF}
    <the strategy's ConfigRecord, unchanged>

Client -> server (train reply)::

    UPLOAD_RECORD: ConfigRecord {PAYLOAD, ARRAYS_KEY, DELTA_REF}
    <the ClientApp's MetricRecord (and any other non-array record), unchanged>
"""

DOWNLOAD_RECORD = "fedcomp.download"
UPLOAD_RECORD = "fedcomp.upload"
RESIDUAL_STATE = "fedcomp.residual"  # Context.state key of the client's error-feedback residual
CODEC_STATE = "fedcomp.codec-state"  # Context.state key of the codec's client state (warm starts, momentum)

PAYLOAD = "payload"  # bytes: a fedcomp wire-format payload
LAYOUT = "layout"  # str: Layout.to_json() of the model
UPLOAD_SPEC = "upload"  # str: codec spec the client must use for its reply
DOWNLOAD_SPEC = "download"  # str: codec spec of PAYLOAD in the broadcast
ERROR_FEEDBACK = "error-feedback"  # bool: keep a residual across rounds
SEED = "seed"  # int: run seed, part of every nonce
ROUND = "round"  # int: server round, part of every nonce
ARRAYS_KEY = "arrays-key"  # str: name of the ArrayRecord the payload stands for
DELTA = "delta"  # float beta: clients encode update - beta * (what they last sent); 0 = off
DELTA_REF = "delta-ref"  # int: round of the reference the delta is against (0: none); per node

LAST_SENT_STATE = "fedcomp.last-sent"  # Context.state: the update the server reconstructed last time
LAST_ROUND_STATE = "fedcomp.last-round"  # Context.state: ConfigRecord {"round": round of LAST_SENT_STATE}
