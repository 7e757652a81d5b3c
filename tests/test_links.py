"""Links: node-config parsing, profiles, tables, byte budgets and simulated round time."""

from __future__ import annotations

import math

import pytest
from flwr.common.config import parse_config_args

from fedcomp import links
from fedcomp.links import Link, LinkError


def node_config(text: str) -> dict:
    """What flower-supernode --node-config "<text>" hands the ClientApp (Flower's own parser)."""
    return parse_config_args([text])


def test_node_config_string_parses_to_link():
    link = links.link_from_node_config(node_config("uplink-kbps=512 downlink-kbps=4096 latency-ms=80"))
    assert link == Link(uplink_kbps=512, downlink_kbps=4096, latency_ms=80)
    capped = links.link_from_node_config(node_config("uplink-kbps=512 downlink-kbps=4096 byte-cap=20000 deadline-s=2.5"))
    assert capped == Link(512, 4096, 0.0, byte_cap=20000, deadline_s=2.5)


@pytest.mark.parametrize("pid", range(12))
def test_node_config_and_mixed_profile_agree(pid):
    """A deployment node configured with the link the 'mixed' profile gives its partition gets the same Link."""
    simulated = links.link_for(pid, 12, "mixed", seed=7)
    deployed = links.link_from_node_config(node_config(simulated.describe()))
    assert deployed == simulated
    # and resolve_link (what the client mod calls) agrees both ways
    assert links.resolve_link({"partition-id": pid, "num-partitions": 12}, "mixed", seed=7) == simulated
    assert links.resolve_link(node_config(simulated.describe()), "none") == simulated


def test_preset_by_name_in_node_config():
    assert links.link_from_node_config(node_config("link='4g'")) == links.PRESETS["4g"]
    assert links.link_from_node_config(node_config("link='4g' latency-ms=10")).latency_ms == 10


def test_mixed_is_seeded_and_independent_of_partition_count():
    a = [links.link_for(i, 50, "mixed", seed=3) for i in range(10)]
    b = [links.link_for(i, 10, "mixed", seed=3) for i in range(10)]
    assert a == b
    names = {links.mixed_preset(i, 3) for i in range(200)}
    assert names == set(links.PRESETS)  # every preset occurs
    assert [links.mixed_preset(i, 3) for i in range(40)] != [links.mixed_preset(i, 4) for i in range(40)]


def test_tables_csv_and_toml(tmp_path):
    csv_path = tmp_path / "links.csv"
    csv_path.write_text("partition-id,uplink-kbps,downlink-kbps,latency-ms,byte-cap,link\n"
                        "0,512,4096,80,,\n1,,,,30000,3g-edge\n")
    toml_path = tmp_path / "links.toml"
    toml_path.write_text('[0]\nuplink-kbps = 512\ndownlink-kbps = 4096\nlatency-ms = 80\n'
                         '[1]\nlink = "3g-edge"\nbyte-cap = 30000\n')
    for path in (csv_path, toml_path):
        table = links.load_table(path)
        assert table[0] == Link(512, 4096, 80)
        assert table[1] == Link(200, 1000, 300, byte_cap=30000)
        assert links.link_for(1, 2, str(path)) == table[1]
        with pytest.raises(LinkError, match="no row for partition 2"):
            links.link_for(2, 3, str(path))


@pytest.mark.parametrize("config, message", [
    ({"uplink-kbps": 0, "downlink-kbps": 1}, "uplink-kbps=0"),
    ({"uplink-kbps": "fast", "downlink-kbps": 1}, "must be a number"),
    ({"downlink-kbps": 10}, "without \\['uplink-kbps'\\]"),
    ({"link": "5g"}, "not a preset"),
    ({"uplink-kbps": 1, "downlink-kbps": 1, "byte-cap": 1.5}, "whole number"),
])
def test_bad_links_are_refused_clearly(config, message):
    with pytest.raises(LinkError, match=message):
        links.link_from_node_config(config)


def test_bad_profiles_are_refused_clearly(tmp_path):
    with pytest.raises(LinkError, match="link-profile 'fiber' is invalid"):
        links.check_profile("fiber")
    with pytest.raises(LinkError, match="does not exist"):
        links.check_profile(str(tmp_path / "missing.csv"))
    with pytest.raises(LinkError, match="outside 0..3"):
        links.link_for(4, 4, "4g")
    with pytest.raises(LinkError, match="no partition-id"):
        links.resolve_link({}, "mixed")
    assert links.link_for(0, 1, "none") is None


def test_time_accounting_hand_computed():
    """Two clients, hand-computed: 1 Mbit/s down, 100 kbit/s up, 50 ms latency; 8 Mbit/s down, 1 Mbit/s up, 10 ms."""
    slow = Link(uplink_kbps=100, downlink_kbps=1000, latency_ms=50)
    fast = Link(uplink_kbps=1000, downlink_kbps=8000, latency_ms=10)
    # slow: download 125,000 B = 1 Mbit -> 1 s + 0.05; compute 0.4; upload 25,000 B = 0.2 Mbit -> 2 s + 0.05
    t_slow = links.client_time(slow, 125_000, 25_000, 0.4)
    assert (t_slow.download_s, t_slow.compute_s, t_slow.upload_s) == pytest.approx((1.05, 0.4, 2.05))
    assert t_slow.total_s == pytest.approx(3.5)
    # fast: 1 Mbit / 8 Mbit/s = 0.125 + 0.01; compute 0.4; 0.2 Mbit / 1 Mbit/s = 0.2 + 0.01
    t_fast = links.client_time(fast, 125_000, 25_000, 0.4)
    assert t_fast.total_s == pytest.approx(0.135 + 0.4 + 0.21)
    assert links.round_time({1: t_slow.total_s, 2: t_fast.total_s}) == (pytest.approx(3.5), [])
    # a 2 s deadline drops the slow client and the round lasts the deadline
    assert links.round_time({1: t_slow.total_s, 2: t_fast.total_s}, deadline_s=2.0) == (2.0, [1])
    assert links.round_time({1: t_slow.total_s, 2: t_fast.total_s}, deadline_s=4.0) == (pytest.approx(3.5), [])


def test_budget_from_deadline_and_cap():
    link = Link(uplink_kbps=100, downlink_kbps=1000, latency_ms=50, deadline_s=3.5)
    # 3.5 - 1.05 (download) - 0.4 (compute) - 0.05 (upload latency) = 2.0 s at 100 kbit/s = 25,000 B
    assert links.upload_budget(link, 125_000, 0.4) == 25_000
    # an upload of exactly that budget ends at the deadline
    assert links.client_time(link, 125_000, 25_000, 0.4).total_s == pytest.approx(3.5)
    assert links.upload_budget(Link(100, 1000, 50, byte_cap=10_000, deadline_s=3.5), 125_000, 0.4) == 10_000
    assert links.upload_budget(Link(100, 1000, 50, byte_cap=10_000), 125_000, 0.4) == 10_000
    assert links.upload_budget(Link(100, 1000, 50), 125_000, 0.4) is None
    assert links.upload_budget(Link(100, 1000, 50, deadline_s=1.0), 125_000, 0.4) == 0
    assert links.with_deadline(Link(100, 1000, 50), 3.0).deadline_s == 3.0
    assert links.with_deadline(Link(100, 1000, 50, deadline_s=1.0), 3.0).deadline_s == 1.0
    assert math.isclose(links.with_deadline(Link(100, 1000, 50), None).latency_ms, 50)
