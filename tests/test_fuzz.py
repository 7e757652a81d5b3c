"""Fuzzing every decoder with hypothesis (bounded for CI), plus hostile layouts and specs.

The targets and mutations live in simulations/fuzz.py, which also drives atheris for long runs.
Property: a decode returns the layout's tensors or raises FedcompError, never another exception,
and never allocates more than the layout and payload size justify.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.base import REGISTRY
from fedcomp.spec import parse_spec
from fedcomp.simulations import fuzz

TARGETS = {t.spec: t for t in fuzz.build_targets()}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


class _HypothesisDraw:
    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi)) if hi > lo else lo

    def bytes(self, n: int) -> bytes:
        return self.data.draw(st.binary(min_size=n, max_size=n))


def test_targets_cover_every_registered_stage_and_policies():
    used = {stage.name for spec in fuzz.all_specs() if ";" not in spec for stage in parse_spec(spec)}
    assert set(REGISTRY) <= used, f"no fuzz target for {sorted(set(REGISTRY) - used)}"
    assert any(fuzz.is_nested(t) for t in TARGETS.values())
    assert "mask" in fuzz.model() and fuzz.model()["mask"].dtype == torch.bool  # bool tensors are fuzzed too


@pytest.mark.parametrize("spec", fuzz.all_specs())
def test_real_payload_decodes(spec):
    target = TARGETS[spec]
    assert fuzz.check(target, target.payload) == "ok"


@pytest.mark.parametrize("spec", fuzz.all_specs())
@FUZZ
@given(data=st.data())
def test_mutated_payloads_raise_only_decode_errors(spec, data):
    target = TARGETS[spec]
    mutated = fuzz.mutate(target.payload, _HypothesisDraw(data), fuzz.is_nested(target))
    fuzz.check(target, mutated)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=300), which=st.integers(0, len(fuzz.all_specs()) - 1))
def test_random_bytes_raise_only_decode_errors(raw, which):
    target = TARGETS[fuzz.all_specs()[which]]
    assert fuzz.check(target, raw) == "rejected"
    # the same bytes behind a valid header and CRC reach the body decoder
    framed = fuzz.fix_crc(target.payload[: fuzz.HEADER_BYTES] + raw + bytes(4), fuzz.is_nested(target))
    fuzz.check(target, framed)


def test_mutation_ops_reach_the_body_decoder():
    """The CRC-fixing mutations must get past the checksum, or the fuzzing proves little."""
    target = TARGETS["topk(ratio=0.1)"]
    p = bytearray(target.payload)
    p[30] ^= 0xFF
    with pytest.raises(fedcomp.DecodeError, match="checksum"):
        target.codec.decode(bytes(p), target.layout)
    with pytest.raises(fedcomp.DecodeError) as info:
        target.codec.decode(fuzz.fix_crc(bytes(p)), target.layout)
    assert "checksum" not in str(info.value)


def _with_u32(payload: bytes, offset: int, value: int) -> bytes:
    data = bytearray(payload)
    data[offset:offset + 4] = struct.pack("<I", value)
    return fuzz.fix_crc(bytes(data))


def test_body_claiming_huge_counts_is_rejected_before_allocating():
    """u32 counts (kept elements, index stream length) at their maximum: typed error, no allocation."""
    target = TARGETS["topk(ratio=0.1)"]
    for value in (2**32 - 1, target.layout.numel + 1):
        bad = _with_u32(target.payload, fuzz.HEADER_BYTES, value)  # the kept count k
        with fuzz.allocation_guard(10 * target.layout.numel):
            with pytest.raises(fedcomp.DecodeError, match="claims|truncated"):
                target.codec.decode(bad, target.layout)
    bad = _with_u32(target.payload, fuzz.HEADER_BYTES + 5, 2**32 - 1)  # the unary stream's length
    with fuzz.allocation_guard(10 * target.layout.numel):
        with pytest.raises(fedcomp.DecodeError, match="truncated"):
            target.codec.decode(bad, target.layout)


@pytest.mark.parametrize("spec", ["none()", "topk(ratio=0.1)", "sketch(rows=3, cols=64)", "randomk(ratio=0.1)",
                                  "powersgd(rank=2)", "numel<100: fp16; sign"])
def test_layout_of_1e12_elements_is_rejected_before_allocating(spec):
    """A layout claiming 10^12 elements (e.g. a hostile broadcast) fails before any allocation."""
    text = json.dumps([["w", [1_000_000, 1_000_000], "float32"]])
    with pytest.raises(fedcomp.SpecError, match="elements"):
        fedcomp.Layout.from_json(text)
    huge = fedcomp.Layout((fedcomp.TensorSpec("w", (1_000_000, 1_000_000), "float32"),))
    codec = fedcomp.build_codec(spec)
    small = codec.encode({"w": torch.randn(8, 8)}).payload
    forged = bytearray(small)
    forged[4:12] = huge.fingerprint()
    with fuzz.allocation_guard(1_000_000):
        with pytest.raises(fedcomp.DecodeError):
            codec.decode(fuzz.fix_crc(bytes(forged), fuzz.is_nested(fuzz.Target(spec, codec, huge, b"", 0))), huge)


def test_allocation_guard_catches_large_requests():
    with fuzz.allocation_guard(100):
        torch.zeros(100)
        with pytest.raises(fuzz.AllocationError):
            torch.zeros(10, 11)
        with pytest.raises(fuzz.AllocationError):
            torch.randint(0, 5, (3, 50))
        with pytest.raises(fuzz.AllocationError):
            torch.randperm(101)
    torch.zeros(1000)  # restored


# -- nothing on the wire is evaluated: hostile layouts and specs get typed errors ---------------
HOSTILE_LAYOUTS = [
    "", "null", "{}", "1", '"w"', "[1]", "[[]]", '[["w"]]', '[["w", [2], "float32", 1]]',
    '[["w", [-1], "float32"]]', '[["w", [2.5], "float32"]]', '[["w", [true], "float32"]]',
    '[["w", "ab", "float32"]]', '[["w", [2], "complex64"]]', '[["w", [2], "object"]]',
    '[[1, [2], "float32"]]', '[["w", [2], "float32"], ["w", [3], "float32"]]',
    '[["w", [1099511627776], "float32"]]', '[["w", [65536, 65536, 65536], "float32"]]',
    "[" * 100_000 + "]" * 100_000, '[["w", [' + "9" * 5000 + '], "float32"]]',
    '{"__class__": "os.system", "args": ["true"]}', "\x80abc", '[["w", [2], "float32"]] trailing',
]


@pytest.mark.parametrize("text", HOSTILE_LAYOUTS, ids=range(len(HOSTILE_LAYOUTS)))
def test_hostile_layout_descriptions_raise_spec_errors(text):
    with pytest.raises(fedcomp.SpecError, match="layout"):
        fedcomp.Layout.from_json(text)


def test_layout_round_trips_through_json():
    layout = fedcomp.Layout.of(fuzz.model())
    assert fedcomp.Layout.from_json(layout.to_json()) == layout


HOSTILE_SPECS = [
    "", "   ", "(", "topk(", "topk(ratio=)", "topk(ratio=0.1,,)", "topk(ratio=0.1)+", "+", "__import__('os')",
    "topk(ratio=__import__)", "eval(1)", "topk(ratio=" + "9" * 5000 + ")", "kbit(bits=" + "1" * 10000 + ")",
    "topk(ratio=1e999)", "topk(ratio=-1e999)", "sketch(seed=" + "9" * 30 + ")", "sketch(seed=-1)",
    "sketch(rows=1, cols=1e300)", "topk(ratio=0.1)+topk(ratio=0.1)", "qsgd+topk", "none(x=1)",
    "numel<²: fp16; sign", "numel<" + "9" * 5000 + ": fp16; sign", "round<1: ; sign", ";;;", "name~: fp16",
    "numel<10: fp16; numel<5: sign", "numel>=abc: fp16; sign", "a" * 100_000, "topk(ratio='0.1')",
    "dgc(clip=1e999)", "kbit(bits=true)", "topk(ratio=0.1)\x00", "tópk(ratio=0.1)",
]


@pytest.mark.parametrize("text", HOSTILE_SPECS, ids=range(len(HOSTILE_SPECS)))
def test_hostile_specs_raise_spec_errors(text):
    with pytest.raises(fedcomp.SpecError):
        fedcomp.build_codec(text)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(list("topk(ratio=0.1)+qsgd,bits4;numel<:~ &'\"e-9x²")), max_size=60))
def test_random_spec_text_raises_only_spec_errors(text):
    try:
        codec = fedcomp.build_codec(text)
    except fedcomp.SpecError:
        return
    assert isinstance(codec.spec, str)


def test_payload_bytes_are_never_unpickled():
    """A pickle stream where a payload belongs is just malformed bytes."""
    import pickle

    target = TARGETS["none()"]
    evil = pickle.dumps({"w": torch.zeros(2)})
    with pytest.raises(fedcomp.DecodeError, match="magic|shorter"):
        target.codec.decode(evil, target.layout)
    framed = fuzz.fix_crc(target.payload[: fuzz.HEADER_BYTES] + evil + bytes(4))
    with pytest.raises(fedcomp.DecodeError):
        target.codec.decode(framed, target.layout)
    assert zlib.crc32(b"") == 0  # fix_crc relies on zlib's CRC32, as the wire format does


# -- budgeted clients declare their codec's free parameters: a hostile declaration is dropped -----
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ratio=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**12)),
       bits=st.integers(-3, 2**40), bucket=st.integers(-3, 2**40), encode_declared=st.booleans())
def test_declared_codec_parameters_are_dropped_or_decoded_never_raise(ratio, bits, bucket, encode_declared):
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.clients.mod import compression_mod
    from conftest import FakeGrid
    from fedcomp import protocol as P
    from fedcomp.strategies.wrapper import CompressedStrategy
    from test_faults import _app, _model, _shift

    declared = f"topk(ratio={ratio!r})+qsgd(bits={bits}, bucket={bucket})".replace("nan", "x").replace("inf", "y")
    model = _model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="topk(ratio=0.1)+qsgd(bits=4)")
    msg = list(strategy.configure_train(1, ArrayRecord(model), ConfigRecord({}), FakeGrid([1])))[0]
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reply = compression_mod(msg, context, _app(_shift(1)))
    record = reply.content.config_records[P.UPLOAD_RECORD]
    record[P.SPEC] = declared
    if encode_declared:
        try:
            delta = {k: v.float() if v.is_floating_point() else v for k, v in _shift(1).items()}
            record[P.PAYLOAD] = fedcomp.build_codec(declared).encode(delta).payload
        except fedcomp.FedcompError:
            pass
    with fuzz.allocation_guard(64 * (fedcomp.Layout.of(model).numel + 8 * len(record[P.PAYLOAD]) + 1024)):
        strategy.aggregate_train(1, [reply])
    status = strategy.rounds[1].clients[0]["status"]
    assert status == "ok" or status.startswith("dropped: "), status


# -- parser hardening: ASCII digits, a linear tokenizer, layouts parsed fast and fingerprinted once --
from fedcomp.spec import MAX_SPEC_CHARS, _Scanner  # noqa: E402


@pytest.mark.parametrize("text", ["kbit(bits=𝟒)", "topk(ratio=0.０1)", "qsgd(bits=٤)", "kbit(bits=²)"])
def test_non_ascii_digits_are_refused_by_name(text):
    with pytest.raises(fedcomp.SpecError, match="digit|cannot parse"):
        fedcomp.build_codec(text)
    if text.startswith("kbit(bits=𝟒"):
        with pytest.raises(fedcomp.SpecError, match="non-ASCII digit '𝟒'.*0-9"):
            fedcomp.build_codec(text)


ADVERSARIAL = {  # inputs that made the old backtracking regular expression quadratic, and friends
    "digits-then-letter": "1" * 100_000 + "a",
    "digits": "9" * 100_000,
    "dots": "1." * 50_000,
    "signs": "+-" * 50_000,
    "exponents": "1e" * 50_000,
    "name": "a" * 100_000,
    "open-quote": "'" + "a" * 100_000,
    "spaces": " " * 100_000 + "x",
    "stages": "topk(ratio=0.01)+" * 5_000 + "none",
    "parens": "(" * 100_000,
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_tokenizer_is_linear(name):
    """Counted, not timed: the scanner looks at each character a bounded number of times."""
    text = ADVERSARIAL[name]
    scanner = _Scanner(text)
    try:
        scanner.tokens()
    except fedcomp.SpecError:
        pass
    assert scanner.steps <= 3 * len(text) + 8, f"{scanner.steps} steps for {len(text)} characters"
    with pytest.raises(fedcomp.SpecError, match=str(MAX_SPEC_CHARS)):  # and parse_spec refuses it before tokenizing
        parse_spec(text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(list("topk(ratio=0.1)+qsgd,bits4 'e-9x²𝟒.٤_")), max_size=200))
def test_tokenizer_steps_stay_linear_on_random_text(text):
    scanner = _Scanner(text)
    try:
        tokens = scanner.tokens()
    except fedcomp.SpecError:
        tokens = None
    assert scanner.steps <= 8 * len(text) + 8  # at most a few looks per character, whatever the text
    if tokens is not None:  # tokens are pieces of the text, in order
        pos = 0
        for _, tok in tokens:
            pos = text.index(tok, pos) + len(tok)


def test_layout_fingerprint_is_computed_once_per_layout(monkeypatch):
    import fedcomp.layout as layout_module

    layout = fedcomp.Layout.from_json(fedcomp.Layout.of(fuzz.model()).to_json())
    codec = fedcomp.build_codec("topk(ratio=0.1)")
    payload = codec.encode(fuzz.model()).payload
    calls = []
    original = layout_module.hashlib.blake2b
    monkeypatch.setattr(layout_module.hashlib, "blake2b", lambda *a, **k: calls.append(1) or original(*a, **k))
    for _ in range(5):
        codec.decode(payload, layout)
    assert len(calls) == 1  # the first decode computes it; the layout keeps it


def test_large_layout_parses_without_rebuilding_its_json(monkeypatch):
    """50,000 entries: one json.loads and one json.dumps, whose text is the fingerprint's input."""
    import json as json_module

    import fedcomp.layout as layout_module

    specs = tuple(fedcomp.TensorSpec(f"layer{i}.weight", (3, i % 7 + 1), "float32") for i in range(50_000))
    text = fedcomp.Layout(specs).to_json()
    dumps = []
    original = json_module.dumps
    monkeypatch.setattr(layout_module.json, "dumps", lambda *a, **k: dumps.append(1) or original(*a, **k))
    layout = fedcomp.Layout.from_json(text)
    assert layout.tensors == specs and layout.to_json() == text
    layout.fingerprint(), layout.fingerprint(), layout.to_json()
    assert len(dumps) == 1


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_mutated_layout_descriptions_raise_only_spec_errors(data):
    text = fedcomp.Layout.of(fuzz.model()).to_json().encode()
    mutated = fuzz.mutate(text + bytes(4), _HypothesisDraw(data))[:-4].decode("utf-8", "replace")
    try:
        layout = fedcomp.Layout.from_json(mutated)
    except fedcomp.SpecError:
        return
    assert fedcomp.Layout.from_json(layout.to_json()) == layout  # what parses, round-trips
    assert layout.fingerprint() == fedcomp.Layout(layout.tensors).fingerprint()


@pytest.mark.parametrize("spec", ["none()", "topk(ratio=0.5)", "kbit(bits=2)", "sketch(rows=2, cols=16)", "powersgd()"])
def test_bool_tensors_are_exact_and_forged_bool_bytes_refused(spec):
    codec = fedcomp.build_codec(spec)
    raw = torch.tensor([1, 0, 2, 255], dtype=torch.uint8).view(torch.bool)  # a bool built by a view holds 2, 255
    tensors = {"w": torch.randn(4, 4), "mask": raw}
    layout = fedcomp.Layout.of(tensors)
    enc = codec.encode(tensors)
    out = codec.decode(enc.payload, layout)
    assert out["mask"].view(torch.uint8).tolist() == [1, 0, 1, 1]  # the same bools, as the bytes 0/1
    forged = bytearray(enc.payload)
    forged[-5] = 2  # the last bool's byte (before the CRC trailer)
    with pytest.raises(fedcomp.DecodeError, match="bool"):
        codec.decode(fuzz.fix_crc(bytes(forged)), layout)


# -- the client mod: a hostile or broken broadcast gets an error reply, never an exception -----------
_VALUES = st.one_of(st.none(), st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.booleans(),
                    st.text(max_size=20), st.binary(max_size=40), st.lists(st.integers(-3, 3), max_size=3))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(edits=st.lists(st.tuples(st.integers(0, 40), _VALUES), min_size=1, max_size=3), round_=st.integers(1, 2))
def test_hostile_broadcast_records_get_error_replies(edits, round_):
    from flwr.app import ArrayRecord, ConfigRecord, Message
    from flwr.serverapp.strategy import FedAvg

    from conftest import FakeGrid, node_context, shift_trainer, tiny_model
    from fedcomp import protocol as P
    from fedcomp.clients.mod import compression_mod
    from fedcomp.strategies.wrapper import CompressedStrategy

    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="topk(ratio=0.1)+qsgd(bits=4)")
    context = node_context(1)
    model = tiny_model(rows=8, cols=6)
    for r in range(1, round_ + 1):  # round 2: the node holds a reference, the broadcast is a chain
        (msg,) = strategy.configure_train(r, ArrayRecord(model), ConfigRecord({}), FakeGrid([1]))
        if r < round_:
            strategy.aggregate_train(r, [compression_mod(msg, context, shift_trainer(1, r))])
    record = msg.content.config_records[P.DOWNLOAD_RECORD]
    keys = sorted(record)
    for i, value in edits:
        key = keys[i % len(keys)]
        if value is None:
            del record[key]
            keys.remove(key)
        else:
            try:
                record[key] = value
            except (TypeError, ValueError):  # a value a ConfigRecord cannot hold never reaches a client
                pass
    raised = []

    def app(m, c):  # a broadcast naming another record makes the app fail, as it should: that is the app's
        try:
            return shift_trainer(1, round_)(m, c)
        except KeyError:
            raised.append(1)
            raise

    try:
        reply = compression_mod(msg, context, app)
    except KeyError:
        assert raised, "the mod raised, not the app"
        return
    assert isinstance(reply, Message)
    if reply.has_error():
        assert reply.error.reason.startswith("fedcomp") or "compression_mod" in reply.error.reason


class _Name(str, enum.Enum):
    W = "w"


def test_layouts_of_recent_tensors_are_one_object_and_any_change_a_new_one():
    import fedcomp.layout as layout_module

    model = fuzz.model()
    first = fedcomp.Layout.of(model)
    assert fedcomp.Layout.of(dict(model)) is first  # the same names, shapes and dtypes
    assert first == layout_module.Layout._of(model) and first.fingerprint() == layout_module.Layout._of(model).fingerprint()
    name, t = next(iter(model.items()))
    changed = [{**model, name: t.reshape(-1)}, {**model, name: t.double()}, dict(reversed(list(model.items()))),
               {"other": t, **{k: v for k, v in model.items() if k != name}}]
    for other in changed:
        got = fedcomp.Layout.of(other)
        assert got is not first and got != first and got == layout_module.Layout._of(other)
    for names in ([1, True, 1.0], ["w", _Name.W]):  # equal dict keys, different names
        for name in names:
            assert fedcomp.Layout.of({name: t}).names == (str(name),)
    listed = type("Listed", (), {"shape": [2, 3], "dtype": torch.float32})()  # a shape that is a list
    assert fedcomp.Layout.of({"l": listed}).tensors[0].shape == (2, 3)
    for n in range(12):  # past the cache's 8: it starts over, the layouts stay right
        assert fedcomp.Layout.of({"w": torch.zeros(n + 1)}).tensors[0].shape == (n + 1,)
    with pytest.raises(fedcomp.SpecError, match="complex64"):
        fedcomp.Layout.of({"z": torch.zeros(2, dtype=torch.complex64)})


LAYOUT_TARGETS = fuzz.build_layout_targets(per_spec=2)


@pytest.mark.parametrize("target", LAYOUT_TARGETS, ids=[t.name for t in LAYOUT_TARGETS])
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_payloads_on_drawn_layouts_raise_only_decode_errors(target, data):
    """Layouts with sizes off every block width, 0-d / empty / many tiny tensors, mixed dtypes."""
    assert fuzz.check(target, target.payload) == "ok"
    fuzz.check(target, fuzz.mutate(target.payload, _HypothesisDraw(data), fuzz.is_nested(target)))
