"""Shaped links: network namespaces + veth pairs + tc rates (``fedcomp.simulations.shaped``), the
relay's latency and token bucket (``fedcomp.simulations.relay``), and Flower's deployment engine on
those links (``fedcomp.simulations.deploy.deployment(links=...)``).

The namespace tests need Linux, root, ``ip`` and ``tc`` (with tbf); elsewhere they are skipped
with the reason :func:`fedcomp.simulations.shaped.available` gives. Rates are checked as bounds
that load cannot break: a shaped transfer is never faster than its rate allows (load only slows
it), and on links of a few Mbit/s a TCP stream needs little CPU, so it reaches 80% of the rate.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fedcomp.links import Link
from fedcomp.simulations import deploy, shaped
from fedcomp.simulations.relay import Relay

OK, WHY = shaped.available()
needs_netns = pytest.mark.skipif(not OK, reason=WHY or "shaped links unavailable")


def test_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shaped.os, "geteuid", lambda: 1000)
    reason = shaped._probe("tbf")
    assert reason is not None and ("root" in reason or "Linux" in reason)


def test_node_links_cycle_the_mix_and_take_presets():
    mix = shaped.node_links("mbit-mix", 8)
    assert [link.uplink_kbps for link in mix] == [1000, 5000, 20000] * 2 + [1000, 5000]
    assert all(link.downlink_kbps == 10 * link.uplink_kbps for link in mix)
    assert shaped.node_links("4g", 2)[1].uplink_kbps == 5000
    with pytest.raises(ValueError, match="not a run's link-profile"):
        shaped.node_links("measured", 2)


def test_relay_token_bucket_paces_and_delays():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                if data.endswith(b"!"):
                    break
            conn.sendall(b"k")

    threading.Thread(target=serve, daemon=True).start()
    nbytes = 500_000  # 2 s at 2,000 kbps
    try:
        with Relay("127.0.0.1", srv.getsockname()[1], up_kbps=2000, down_kbps=8000, latency_ms=100) as relay:
            with socket.create_connection(("127.0.0.1", relay.port)) as s:
                t0 = time.perf_counter()
                s.sendall(b"x" * (nbytes - 1) + b"!")
                assert s.recv(1) == b"k"
                seconds = time.perf_counter() - t0
        rate = nbytes * 8 / 1000 / (seconds - 0.2)  # less the latency both ways
        assert rate <= 2000 * 1.05, f"{rate:.0f} kbps through a 2,000 kbps token bucket"
        assert rate >= 2000 * 0.8, f"{rate:.0f} kbps through a 2,000 kbps token bucket"
    finally:
        srv.close()


@needs_netns
def test_tc_enforces_each_direction():
    links = [Link(uplink_kbps=2000, downlink_kbps=8000, latency_ms=0), Link(uplink_kbps=4000, downlink_kbps=4000, latency_ms=0)]
    with shaped.ShapedNetwork(links) as net:
        names = [n.netns for n in net.nodes]
        for i, link in enumerate(links):
            for direction, rate in (("up", link.uplink_kbps), ("down", link.downlink_kbps)):
                r = shaped.measure_throughput(net, i, direction, nbytes=int(rate * 1000 / 8 * 1.5))
                assert 0.8 * rate <= r["kbps"] <= 1.08 * rate, (i, direction, r)
    out = shaped._run(["ip", "netns", "list"]).stdout
    assert not any(name in out for name in names), "namespaces left behind"


@needs_netns
def test_stale_namespaces_of_dead_runs_are_removed():
    dead = 2**22 + 7  # above pid_max's default: no such process
    name = f"{shaped.PREFIX}-{dead}-0"
    shaped._run(["ip", "netns", "add", name])
    try:
        assert name in shaped.cleanup_stale()
    finally:
        shaped._run(["ip", "netns", "del", name], check=False)


@needs_netns
def test_fedcomp_run_on_kernel_shaped_links(tmp_path):
    """2 SuperNodes in their namespaces, 1 round of the project's app (digits mlp, measured links):
    it completes, every node's bytes went through its own relay, and each round lasted at least
    as long as the slowest node's broadcast takes at its shaped downlink."""
    links = [Link(uplink_kbps=1000, downlink_kbps=4000, latency_ms=20),
             Link(uplink_kbps=5000, downlink_kbps=20000, latency_ms=10)]
    with deploy.deployment(tmp_path / "dep", 2, links=links, shaping="kernel") as dep:
        assert dep.shaping == "kernel" and len(dep.node_relays) == 2
        run = deploy.run_app(dep, "num-server-rounds=1 model='mlp' link-profile='measured' round-deadline-s=10.0 "
                             "upload=\"topk(ratio=0.01,index='fixed')+qsgd(bits=4)\"", tmp_path / "run", timeout=600)
        per_node = [r.counts() for r in dep.node_relays]
        names = [n.netns for n in dep.net.nodes]
    assert run.ok, run.log[-3000:]
    assert [r["round"] for r in run.results["rounds"]] == [1]
    assert all(c.server_to_client > 900_000 for c in per_node)  # each node got the dense mlp broadcasts
    for r in run.rounds:
        slowest = r.download_bytes / len(links) * 8 / (links[0].downlink_kbps * 1000)
        assert r.seconds >= 0.9 * slowest
    estimates = [e for r in run.results["rounds"] for e in r["link_estimates"]]
    assert estimates and all(e["status"] == "ok" for e in estimates)
    out = shaped._run(["ip", "netns", "list"]).stdout
    assert not any(name in out for name in names), "namespaces left behind"


def test_the_estimates_table_counts_wire_timed_transfers_and_their_rate():
    """deploy_links' report from a measured run's results: errors against the shaped rates from
    round 5, and per direction how many transfers the SuperNode timed on the wire and their wire
    time over the shaped link's time for their bytes (1.0: the wire carried the shaped rate)."""
    from fedcomp.simulations import deploy_links

    link = Link(1000, 10000, 50)
    rounds = []
    for r in range(1, 7):
        rounds.append({"round": r, "link_estimates": [{
            "node": 77, "est_up_kbps": 1100.0, "est_down_kbps": 9000.0 if r < 6 else 5000.0, "timed_by": "supernode",
            "observed_up_s": 0.5, "observed_down_s": 2.0, "link_up_bytes": 50_000, "link_down_bytes": 1_000_000,
            "wire_up_s": 0.4 if r > 2 else None, "wire_down_s": 0.8, "budget": 1, "compute_s": 1.0}]})
    errors = deploy_links.estimator_errors({"rounds": rounds}, {77: 0}, [link])
    assert [e["wire_up_s"] for e in errors][:3] == [None, None, 0.4]
    table = deploy_links.write_estimates(errors, [link])
    assert "| 0 | 1,000 / 10,000 |" in table and "+10%..+10% | -50%..-10% |" in table
    assert "within 15% of the shaped rate in 2/2 node-rounds, downlink in 1/2" in table
    assert "| down | 1,000,000 | 2.00 | 0.85 | 1.15 / 1.15 / 1.15 | 6 of 6 | 1.000 / 1.000 / 1.000 |" in table
    assert "| up | 50,000 | 0.50 | 0.45 | 0.05 / 0.05 / 0.05 | 4 of 6 | 1.000 / 1.000 / 1.000 |" in table
