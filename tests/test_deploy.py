"""Flower's deployment engine on loopback: SuperLink + SuperNodes over gRPC, bytes measured on the wire.

The slow tests start a SuperLink with its Fleet API behind a byte-counting relay
(``fedcomp.simulations.relay``) and SuperNodes that connect through it (``fedcomp.simulations.deploy``), run
``flwr run .`` and compare what the relay forwarded with what ``results.json`` reports. Every
process is started in its own session and stopped by PID in ``finally`` (inside
``fedcomp.simulations.deploy.deployment``). The fast tests check the relay, its HTTP/2 meter and the
certificate script without Flower.
"""

from __future__ import annotations

import socket
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key, load_ssh_public_key

from fedcomp.simulations import deploy
from fedcomp.simulations.certs import make_ca_and_server_cert, make_node_keys
from fedcomp.simulations.relay import H2_FIELDS, Relay, _H2Meter

COMPRESSED = "topk(ratio=0.01)+qsgd(bits=4)"
ROUNDS = 1
CLIENTS = 2

# What the relay sees from SuperNodes beyond results.json's upload bytes (serialized content)
# in one round, per client. Measured on this 2-core machine (README, "Deployment"): every Fleet
# RPC costs ~680 B besides the content (~505 B of HTTP/2 request headers, mostly the node's
# public key, a timestamp and a signature that a SuperNode sends with every call, ~65 B of HTTP/2
# and gRPC framing, ~105 B of protobuf envelope). A reply takes ~10 RPCs (PullObject and
# PushObject per object, ConfirmMessageReceived, PushMessages; round 1 also GetRun and GetFab),
# and while the round lasts each node polls (PullMessages every 3 s, a heartbeat every ~20 s):
# ~220 B/s. Measured: 9.4-15.1 KB per client-round for 18-44 s rounds. The bound allows about
# twice both parts, and does not depend on the payload: the dense run's overhead is the same.
# These are flower-supernode's figures (the test runs it): fedcomp's SuperNode polls more often
# while a run is active (every 0.5 s right after a reply), trading idle bytes for shorter rounds.
OVERHEAD_PER_REPLY = 16_000  # bytes per client per round
POLLING_PER_SECOND = 400  # bytes per client per second of the round


# --------------------------------------------------------------------------- fast: relay, certs


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data[: len(data) // 2 + 1])

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_relay_counts_both_directions_exactly():
    srv = _echo_server()
    try:
        with Relay("127.0.0.1", srv.getsockname()[1]) as relay:
            assert relay.address.startswith("127.0.0.1:")
            with socket.create_connection(("127.0.0.1", relay.port)) as s:
                s.sendall(b"x" * 3_000_000)
                s.shutdown(socket.SHUT_WR)
                got = 0
                while data := s.recv(65536):
                    got += len(data)
            counts = relay.counts()
            assert counts.client_to_server == 3_000_000
            assert counts.server_to_client == got > 0
            assert counts.connections == 1
            # not HTTP/2: everything is counted as opaque
            h2 = relay.http2_counts()
            assert h2["client_to_server"]["opaque_bytes"] == 3_000_000
    finally:
        srv.close()


def _frame(ftype: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def test_http2_meter_splits_frames_headers_and_grpc_messages():
    stats = dict.fromkeys(H2_FIELDS, 0)
    meter = _H2Meter(stats, client_side=True)
    body1, body2 = b"a" * 20_000, b"b" * 7
    grpc = b"\x00" + len(body1).to_bytes(4, "big") + body1 + b"\x00" + len(body2).to_bytes(4, "big") + body2
    stream = (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _frame(4, 0, 0, b"\x00\x03\x00\x00\x00\x64")  # SETTINGS
        + _frame(1, 4, 1, b"h" * 50)  # HEADERS
        + _frame(0, 0, 1, grpc[:16_384])  # DATA, the first message split over two frames
        + _frame(0, 0x8, 1, bytes([3]) + grpc[16_384:] + b"\x00" * 3)  # DATA, padded
        + _frame(8, 0, 0, b"\x00\x00\x10\x00")  # WINDOW_UPDATE
        + _frame(1, 5, 3, b"h" * 10)  # second call
    )
    for i in range(0, len(stream), 1000):  # arbitrary chunking
        meter.feed(stream[i:i + 1000])
    assert stats["preface_bytes"] == 24
    assert stats["frames"] == 6 and stats["frame_header_bytes"] == 54
    assert stats["headers_bytes"] == 60 and stats["streams"] == 2
    assert stats["grpc_messages"] == 2 and stats["grpc_prefix_bytes"] == 10
    assert stats["grpc_body_bytes"] == len(body1) + len(body2)
    assert stats["padding_bytes"] == 4 and stats["control_bytes"] == 10
    assert sum(v for k, v in stats.items() if k.endswith("_bytes")) == len(stream)


def test_certs_and_node_keys(tmp_path):
    tls = make_ca_and_server_cert(tmp_path, hosts=["superlink.example.org", "10.1.2.3"])
    ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(tls.server_cert.read_bytes())
    assert cert.issuer == ca.subject
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "superlink.example.org"} <= set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.1.2.3"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert isinstance(load_pem_private_key(tls.server_key.read_bytes(), None), ec.EllipticCurvePrivateKey)
    assert tls.server_key.stat().st_mode & 0o077 == 0
    (key,) = make_node_keys(tmp_path / "keys", ["node-a"])
    private = load_ssh_private_key(key.private_key.read_bytes(), None)
    public = load_ssh_public_key(key.public_key.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert private.public_key().public_numbers() == public.public_numbers()


# ------------------------------------------------------------------- slow: SuperLink + SuperNodes


def _check_run(run: deploy.RunResult, rounds: int) -> None:
    assert run.ok, run.log[-4000:]
    assert [r["round"] for r in run.results["rounds"]] == list(range(1, rounds + 1))
    for r in run.results["rounds"]:
        assert len(r["clients"]) == CLIENTS and all(c["status"] == "ok" for c in r["clients"]), r["clients"]
    # every round was seen on its own (a relay snapshot per round)
    assert [r.round for r in run.rounds] == list(range(1, rounds + 1))


MEASURED = "link-profile='measured' round-deadline-s=600.0"  # a deadline no loopback round comes near


def _check_estimates(run: deploy.RunResult, rounds: int, supernode: str = "fedcomp") -> None:
    """Measured links on loopback: every node's transfers were timed and its estimate recorded,
    every round; its upload fit the budget the estimate gave (round 1: the first-contact probe).
    Under fedcomp's SuperNode (deploy's default) the SuperNode timed them, and a reply's push is
    reported with the node's next reply: round 1 has no upload timing yet. Under Flower's the
    server timed both from the wall clocks."""
    for r in run.results["rounds"]:
        rows = r["link_estimates"]
        assert sorted(e["node"] for e in rows) == sorted(c["node"] for c in r["clients"]), rows
        for e in rows:
            assert e["status"] == "ok" and e["budget_status"] == "ok", e
            if supernode == "flower":
                assert "timed_by" not in e and e["observed_down_s"] > 0 and e["observed_up_s"] > 0, e
                assert e["est_up_kbps"] > 0 and e["est_down_kbps"] > 0 and e["est_up_latency_s"] >= 0, e
                assert 0 < e["upload_bytes"] <= e["budget"], e
                if r["round"] == 1:
                    assert "byte-cap=4096" in e["sent_link"] and e["budget"] == 4096, e
                continue
            assert e["timed_by"] == "supernode" and e["link_down_bytes"] > 0, e
            assert e["observed_down_s"] > 0 and e["est_down_kbps"] > 0, e
            # the SuperNode's pull is part of what the wall clocks saw
            assert e["observed_down_s"] < e["wall_s"], e
            if r["round"] == 1:
                assert e["observed_up_s"] is None and e["est_up_kbps"] is None, e
                assert "byte-cap=4096" in e["sent_link"] and e["budget"] == 4096, e
            else:
                assert e["observed_up_s"] > 0 and e["link_up_bytes"] > 0 and e["est_up_kbps"] > 0, e
                assert e["overhead_s"] > 0, e
            assert 0 < e["upload_bytes"] <= e["budget"], e
    assert len(run.results["rounds"]) == rounds


@pytest.mark.slow
def test_insecure_deployment_compressed_vs_dense(tmp_path):
    with deploy.deployment(tmp_path / "deploy", CLIENTS, supernode="flower") as dep:  # Flower's wire, as is
        assert len(set(dep.activated_nodes())) == CLIENTS
        assert all(p.popen.args[0] == "flower-supernode" for p in dep.supernodes)
        common = f"num-server-rounds={ROUNDS} model='mlp-large'"
        # the compressed run also measures the nodes' links (link-profile='measured': nothing declared; the
        # server times each transfer and sends each node its estimate; first contact: a 4 kB probe)
        compressed = deploy.run_app(dep, f"{common} upload='{COMPRESSED}' {MEASURED}", tmp_path / "compressed",
                                    timeout=300)
        _check_run(compressed, ROUNDS)
        _check_estimates(compressed, ROUNDS, supernode="flower")
        dense = deploy.run_app(dep, f"{common} upload='none()'", tmp_path / "dense", timeout=300)
        _check_run(dense, ROUNDS)
        for run in (compressed, dense):  # Flower starts one ClientApp process per message
            assert run.clientapps["processes"] == ROUNDS * CLIENTS, run.clientapps
    print("\n" + deploy.format_table(compressed) + "\n" + deploy.format_breakdown(
        compressed.http2, compressed.rpcs, compressed.upload_bytes))
    print(deploy.format_table(dense) + "\n" + deploy.format_breakdown(dense.http2, dense.rpcs, dense.upload_bytes))

    # The 50x: what really crossed the wire from the SuperNodes, whole runs.
    ratio = dense.total.client_to_server / compressed.total.client_to_server
    assert ratio >= 50, (dense.total, compressed.total)

    # Relay bytes vs results.json, round by round: the wire carries the content plus a fixed
    # overhead (see OVERHEAD_PER_REPLY), the same for a 35 KB and a 8.7 MB reply.
    for run in (compressed, dense):
        for r in run.rounds:
            assert r.clients == CLIENTS
            budget = CLIENTS * (OVERHEAD_PER_REPLY + POLLING_PER_SECOND * r.seconds)
            assert 0 < r.overhead <= budget, (r, budget)
            assert r.relay.server_to_client >= r.download_bytes  # the broadcasts crossed the relay too

    # The HTTP/2 breakdown adds up, and the gRPC bodies hold the content.
    for run in (compressed, dense):
        c2s = run.http2["client_to_server"]
        assert c2s["opaque_bytes"] == 0
        assert sum(v for k, v in c2s.items() if k.endswith("_bytes")) == run.total.client_to_server
        assert c2s["grpc_body_bytes"] >= run.upload_bytes
        assert run.rpcs.get("PushMessages", 0) == ROUNDS * CLIENTS
        # one HTTP/2 stream per Fleet RPC (a call in flight at either end of the window may
        # be counted on one side only)
        assert abs(c2s["streams"] - sum(run.rpcs.values())) <= 2 * CLIENTS, (c2s["streams"], run.rpcs)
