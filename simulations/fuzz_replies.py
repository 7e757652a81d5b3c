"""Fuzz targets for what a hostile client controls in a reply: metrics, integer buffers, and which
replies reach the server (duplicates, foreign nodes, rewritten tags and payloads).

The property is the one of :mod:`fedcomp.simulations.fuzz`: every input is either accepted, and then
within every bound the guards promise, or refused with a :class:`fedcomp.FedcompError` naming why;
any other exception (an *untyped* failure) is a bug. Targets:

``metrics``
    A reply's records: 0-3 MetricRecords, names of any length, the weight key in none, one or
    several of them, values of every kind Flower carries (ints past 2**63 excluded: Flower refuses
    them), non-finite floats, lists of any length. :func:`fedcomp.strategies.guards.check_metrics`
    and :func:`fedcomp.aggregate.check_weight` accept or refuse; a round of accepted ones of the
    majority schema is then aggregated by Flower's own metric function, which must not raise.
``buffers``
    An update's integer buffers and running variances (any dtype, extreme values, sparse or dense
    pieces) against a base model: :class:`fedcomp.strategies.guards.StateGuard` accepts (and then
    ``base + update`` keeps every variance >= 0 and no integer step exceeds the bound) or refuses.
``replies``
    A round of a wrapped FedAvg on a small model, its honest replies then mutated: duplicated,
    sent from a node never messaged, tags flipped, stripped or swapped between nodes, last round's
    payload replayed with its nonce rewritten and its CRC recomputed, upload fields deleted or
    retyped, delivered in a random order. The round must end with each node aggregated at most
    once, no reply with a tag not made with its node's token aggregated, a finite model, and only
    typed refusals. One input is one reply.

Command (counts every input; ``--inputs`` is split over the targets as ``--mix`` says)::

    python -m fedcomp.simulations.fuzz_replies --inputs 1000000 --seed 0
"""

from __future__ import annotations

import argparse
import math
import random
import struct
import sys
import time
import traceback

import torch

import fedcomp

WEIGHT = "num-examples"
TARGETS = ("metrics", "buffers", "replies")
MIX = {"metrics": 0.7, "buffers": 0.28, "replies": 0.02}  # share of the inputs per target (replies: ~15 ms each)


class UntypedFailure(AssertionError):
    """An input that made a guard fail with something else than a FedcompError, or broke a promise."""


# -- metrics ---------------------------------------------------------------------------------------
def _name(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.5:
        return rng.choice(["train_loss", "accuracy", WEIGHT, "lr", "n"])
    if pick < 0.6:
        return ""
    if pick < 0.7:
        return "x" * rng.choice([1, 128, 129, 5000])
    return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(1, 12)))


def _value(rng: random.Random):
    pick = rng.random()
    if pick < 0.3:
        return rng.choice([0, 1, -1, 10, 2**53, 2**53 + 1, -(2**53) - 1, 2**63 - 1, -(2**63)])
    if pick < 0.6:
        return rng.choice([0.0, -0.0, 1.5, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf, rng.gauss(0, 1e6)])
    n = rng.choice([0, 1, 3, 1024, 1025]) if rng.random() < 0.3 else rng.randrange(0, 8)
    if rng.random() < 0.5:
        return [rng.choice([1.0, math.nan, math.inf, rng.random()]) for _ in range(n)]
    return [rng.choice([1, -5, 2**53 + 1]) for _ in range(n)]


def metric_records(rng: random.Random):
    """A reply's RecordDict of 0-3 MetricRecords (what Flower would deliver)."""
    from flwr.app import MetricRecord, RecordDict

    content = RecordDict()
    for i in range(rng.choice([0, 1, 1, 1, 1, 2, 3])):
        items = {}
        for _ in range(rng.randrange(0, 6)):
            items[_name(rng)] = _value(rng)
        if rng.random() < 0.8:
            items[WEIGHT] = _value(rng) if rng.random() < 0.3 else rng.randrange(1, 300)
        try:
            content[f"metrics{i}" if i else "metrics"] = MetricRecord(items)
        except (TypeError, ValueError):  # Flower refuses the record: it never reaches a strategy
            continue
    return content


def fuzz_metrics(rng: random.Random, count: int) -> int:
    """``count`` replies' metrics, aggregated in rounds of up to 10 accepted ones; returns inputs run."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
    from flwr.app import MetricRecord, RecordDict

    from fedcomp.aggregate import check_weight
    from fedcomp.strategies.guards import check_metrics, majority_schema

    done, accepted = 0, []
    while done < count:
        content = metric_records(rng)
        done += 1
        try:
            name, metrics, schema = check_metrics(content, WEIGHT)
            weight = check_weight(metrics[WEIGHT])
        except fedcomp.FedcompError:
            continue
        if not (math.isfinite(weight) and weight > 0):
            raise UntypedFailure(f"check_weight accepted {metrics[WEIGHT]!r}")
        for key, value in metrics.items():
            values = value if isinstance(value, list) else [value]
            if key != WEIGHT and not all(math.isfinite(float(v)) for v in values):
                raise UntypedFailure(f"check_metrics accepted a non-finite {key!r}: {value!r}")
        accepted.append((schema, RecordDict({name: MetricRecord({**metrics, WEIGHT: weight})})))
        if len(accepted) >= rng.randrange(1, 11):
            majority = majority_schema([s for s, _ in accepted])
            aggregate_metricrecords([r for s, r in accepted if s == majority], WEIGHT)  # must not raise
            accepted = []
    return done


# -- integer buffers and running variances -----------------------------------------------------------
def fuzz_buffers(rng: random.Random, count: int) -> int:
    from fedcomp.aggregate import Accumulator, Update
    from fedcomp.strategies.guards import MAX_INTEGER_STEP, ReplyRejected, StateGuard

    g = torch.Generator().manual_seed(rng.randrange(2**31))
    base = {"fc.weight": torch.randn(6, 4, generator=g), "bn.running_mean": torch.randn(6, generator=g),
            "bn.running_var": torch.rand(6, generator=g) + 0.01, "bn.num_batches_tracked": torch.tensor(40),
            "emb.index": torch.arange(5, dtype=torch.int32), "mask": torch.ones(3, dtype=torch.uint8)}
    layout = fedcomp.Layout.of(base)
    offsets = Accumulator.offsets(layout)
    guard = StateGuard(layout, offsets)
    extremes = [0, 1, -1, 7, MAX_INTEGER_STEP, MAX_INTEGER_STEP + 1, -MAX_INTEGER_STEP - 1, 2**31 - 1, -(2**31),
                2**62, -(2**63), 2**63 - 1]
    done = 0
    while done < count:
        done += 1
        ints = {}
        for t in layout.tensors:
            if t.is_float or rng.random() < 0.1:
                continue
            dtype = rng.choice([t.torch_dtype, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
            info = torch.iinfo(dtype)
            vals = [max(info.min, min(info.max, rng.choice(extremes) if rng.random() < 0.5 else rng.randrange(-9, 10)))
                    for _ in range(t.numel)]
            ints[t.name] = torch.tensor(vals, dtype=dtype).reshape(t.shape)
        parts = []
        a, n = offsets["bn.running_var"]
        var = torch.tensor([rng.choice([0.0, -0.0, 0.5, -0.005, -1.0, -1e30, 1e30, rng.gauss(0, 0.3)]) for _ in range(n)])
        if rng.random() < 0.5:  # dense: the whole flat buffer, or a piece of it
            flat = torch.zeros(sum(m for _, m in offsets.values()))
            flat[a:a + n] = var
            lo = rng.randrange(0, a + 1)
            parts.append((lo, None, flat[lo:]))
        else:  # sparse: positions relative to a segment start
            start = rng.choice([0, a - 2, a])
            pos = torch.tensor(sorted(rng.sample(range(a - start, a - start + n), rng.randrange(0, n + 1))),
                               dtype=torch.int64)
            parts.append((start, pos, var[pos - (a - start)] if pos.numel() else var[:0]))
        update = Update(parts, ints)
        try:
            guard.check(update, base)
        except ReplyRejected:
            continue
        for name, t in ints.items():
            if t.numel() and int(t.to(torch.int64).abs().max()) > MAX_INTEGER_STEP:
                raise UntypedFailure(f"StateGuard accepted a step of {int(t.to(torch.int64).abs().max())} in {name!r}")
            if name == "bn.num_batches_tracked" and int(t.to(torch.int64).min()) < 0:
                raise UntypedFailure("StateGuard accepted a counter going down")
        new = base["bn.running_var"].double().clone()
        for start, pos, vals in parts:
            if pos is None:
                lo, hi = max(start, a), min(start + vals.numel(), a + n)
                new[lo - a:hi - a] += vals[lo - start:hi - start].double()
            else:
                p = pos + start
                m = (p >= a) & (p < a + n)
                new[p[m] - a] += vals[m].double()
        if bool((new < 0).any()):
            raise UntypedFailure(f"StateGuard accepted a negative variance {new.tolist()}")
    return done


# -- duplicate, foreign and rewritten replies ----------------------------------------------------------
def _from(reply, node):
    from flwr.app import Message, Metadata

    fields = {f: getattr(reply.metadata, f) for f in ("run_id", "message_id", "dst_node_id", "reply_to_message_id",
                                                      "group_id", "created_at", "ttl", "message_type")}
    return Message(metadata=Metadata(src_node_id=node, **fields), content=reply.content)


def _copy(reply):
    from flwr.app import ConfigRecord, RecordDict

    content = RecordDict({k: (ConfigRecord(dict(v)) if isinstance(v, ConfigRecord) else v)
                          for k, v in reply.content.items()})
    out = _from(reply, reply.metadata.src_node_id)
    out.content = content
    return out


def fuzz_replies(rng: random.Random, count: int, nodes: int = 4) -> int:
    """Rounds of a wrapped FedAvg whose replies are mutated; returns the replies run."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from fedcomp import protocol as P
    from fedcomp.clients.mod import compression_mod
    from fedcomp.strategies.wrapper import CompressedStrategy
    from fedcomp.wire import HEADER, REPLY_TAG, crc32, reply_tag

    for name in ("run_id", "task_id", "node_id"):  # what a Flower process sets
        try:
            getattr(TaskIdentity, name)
        except RuntimeError:
            setattr(TaskIdentity, name, 1)

    class Grid:
        def __init__(self, ids):
            self.ids = ids

        def get_node_ids(self):
            return self.ids

    ids = list(range(1, nodes + 1))
    done = 0
    while done < count:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        model = {"w": torch.randn(12, 8, generator=g), "b": torch.randn(12, generator=g), "steps": torch.tensor(3)}
        strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes,
                                             min_train_nodes=nodes),
                                      upload=rng.choice(["topk(ratio=0.2)+qsgd(bits=4)", "qsgd(bits=8)", "kbit(bits=4)"]),
                                      max_failed_rounds=10**6)
        contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": n - 1}, state=RecordDict(),
                               run_config={}) for n in ids}
        last: dict[int, tuple[bytes, bytes]] = {}
        for rnd in range(1, 4):
            messages = list(strategy.configure_train(rnd, ArrayRecord(model), ConfigRecord({}), Grid(ids)))
            tokens = {m.metadata.dst_node_id: int(m.content.config_records[P.DOWNLOAD_RECORD]["reply-token"])
                      for m in messages}
            honest = []
            for msg in messages:
                node = msg.metadata.dst_node_id

                def app(m, c, node=node):
                    got = m.content.array_records["arrays"].to_torch_state_dict()
                    gg = torch.Generator().manual_seed(node * 97 + rnd)
                    out = {k: v + 0.05 * torch.randn(v.shape, generator=gg) if v.is_floating_point() else v + 1
                           for k, v in got.items()}
                    return Message(RecordDict({"arrays": ArrayRecord(out),
                                               "metrics": MetricRecord({WEIGHT: 10 + node})}), reply_to=m)
                honest.append(compression_mod(msg, contexts[node], app))
            sent = []
            for reply in honest:
                node = reply.metadata.src_node_id
                record = reply.content.config_records[P.UPLOAD_RECORD]
                payload = bytes(record[P.PAYLOAD])
                previous, last[node] = last.get(node), (payload, bytes(record[REPLY_TAG]))
                for _ in range(rng.choice([0, 1, 1, 2, 3])):
                    op = rng.randrange(9)
                    if op == 0:
                        sent.append(_copy(reply))  # a duplicate
                    elif op == 1:
                        sent.append(_from(_copy(reply), rng.choice([0, 99, -1, 2**63 - 1, node + nodes])))  # foreign
                    elif op == 2 and isinstance(record.get(REPLY_TAG), bytes) and record[REPLY_TAG]:
                        tag = bytearray(record[REPLY_TAG])
                        tag[rng.randrange(len(tag))] ^= 1 << rng.randrange(8)
                        record[REPLY_TAG] = bytes(tag)
                    elif op == 3:
                        record.pop(REPLY_TAG, None)
                    elif op == 4 and previous is not None:  # last round's payload, nonce rewritten, CRC fixed
                        old = bytearray(previous[0])
                        fields = list(HEADER.unpack_from(old))
                        fields[-1] = rng.randrange(2**64)
                        HEADER.pack_into(old, 0, *fields)
                        old[-4:] = struct.pack("<I", crc32(bytes(old[:-4])))
                        record[P.PAYLOAD] = bytes(old)
                        record[REPLY_TAG] = rng.choice([previous[1], record.get(REPLY_TAG, previous[1])])
                    elif op == 5:  # another node's token (a tag made for node+1)
                        other = tokens[ids[(ids.index(node) + 1) % len(ids)]]
                        if isinstance(record.get(P.PAYLOAD), bytes):
                            record[REPLY_TAG] = reply_tag(record[P.PAYLOAD], other)
                    elif op == 6:
                        key = rng.choice([P.TIER, P.REF_VERSION, P.REF_CRC, P.ARRAYS_KEY, P.PAYLOAD])
                        record.pop(key, None)
                    elif op == 7:
                        key = rng.choice([P.TIER, P.REF_VERSION, P.REF_CRC, REPLY_TAG])
                        record[key] = rng.choice([-1, 2**62, "x", 1.5, b"\x00" * 8, [1, 2]])
                    else:
                        record[P.SPEC] = rng.choice(["topk(ratio=1.0)+qsgd(bits=8)", "none()", "kbit(bits=8)"])
                sent.append(reply)
            rng.shuffle(sent)
            done += len(sent)
            try:
                for reply in sent:
                    strategy._on_reply(reply)
                arrays, _ = strategy.aggregate_train(rnd, sent)
            except fedcomp.FedcompError:
                continue
            stats = strategy.rounds[rnd]
            ok = [c["node"] for c in stats.clients if c["status"] == "ok"]
            if len(ok) != len(set(ok)) or not set(ok) <= set(ids) or stats.aggregated != len(ok):
                raise UntypedFailure(f"round {rnd}: aggregated {stats.aggregated}, ok {ok}")
            for node in ok:  # the reply taken for a node is its first delivered: its tag is its token's
                first = next(r for r in sent if r.metadata.src_node_id == node)
                record = first.content.config_records[P.UPLOAD_RECORD]
                if record.get(REPLY_TAG) != reply_tag(bytes(record[P.PAYLOAD]), tokens[node]):
                    raise UntypedFailure(f"round {rnd}: node {node}'s reply aggregated with a tag not made for it")
            if arrays is not None:
                model = arrays.to_torch_state_dict()
                if not all(bool(torch.isfinite(t.float()).all()) for t in model.values()):
                    raise UntypedFailure(f"round {rnd}: the model is not finite")
    return done


RUNNERS = {"metrics": fuzz_metrics, "buffers": fuzz_buffers, "replies": fuzz_replies}


def run(inputs: int, seed: int = 0, targets: tuple[str, ...] = TARGETS, chunk: int = 1000) -> dict:
    """Run ``inputs`` inputs over ``targets`` (shares :data:`MIX`); per target the inputs run and the
    untyped failures (each: the first line of its traceback and the seed of its chunk)."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER  # (imported first: it sets its own level on import)

    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.ERROR)  # every refusal logs a warning: millions of them
    try:
        return _run(inputs, seed, targets, chunk)
    finally:
        FLOWER_LOGGER.setLevel(level)


def _run(inputs: int, seed: int, targets: tuple[str, ...], chunk: int) -> dict:
    share = sum(MIX[t] for t in targets)
    report = {}
    for target in targets:
        want, done, failures, t0 = int(inputs * MIX[target] / share), 0, [], time.perf_counter()
        chunk_seed = seed
        while done < want:
            rng = random.Random(f"{target}/{chunk_seed}")
            try:
                done += RUNNERS[target](rng, min(chunk, want - done))
            except Exception as exc:  # noqa: BLE001 - the point: every untyped failure, recorded
                failures.append({"seed": chunk_seed, "error": f"{type(exc).__name__}: {exc}"[:500],
                                 "where": traceback.format_exc().strip().splitlines()[-3:]})
                done += chunk
            chunk_seed += 1
        report[target] = {"inputs": done, "untyped_failures": len(failures), "failures": failures[:10],
                          "seconds": round(time.perf_counter() - t0, 1)}
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs in all (default 1,000,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", action="append", choices=TARGETS, help="only these targets (repeatable)")
    args = parser.parse_args(argv)
    if args.inputs < 1:
        parser.error(f"--inputs={args.inputs} is invalid: a positive number of inputs")
    torch.set_num_threads(1)
    report = run(args.inputs, args.seed, tuple(args.target or TARGETS))
    total = sum(r["inputs"] for r in report.values())
    untyped = sum(r["untyped_failures"] for r in report.values())
    for target, r in report.items():
        print(f"{target}: {r['inputs']:,} inputs, {r['untyped_failures']} untyped failures, {r['seconds']} s")
        for f in r["failures"]:
            print(f"  seed {f['seed']}: {f['error']}\n    " + "\n    ".join(f["where"]))
    print(f"total: {total:,} inputs, {untyped} untyped failures")
    sys.exit(1 if untyped else 0)


if __name__ == "__main__":
    main()
