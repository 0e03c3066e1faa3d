"""netem's pure parts: topology files and generators, the RIPE derivation, the fabric's schedule, tc commands."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from netem import netns, ripe
from netem.layout import Layout
from netem.probe import RttMeasurement
from netem.schedule import NS_PER_MS, Schedule
from netem.tc import TcBackend, downlink_removals, host_commands, netem_args, update_commands
from netem.topology import Topology, TopologyError, constant, random_geometric, uniform

RIPE_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "ripe_atlas_eu_rtt.csv"
ISSUE_EXAMPLE = {"hosts": ["h0", "h1", "h2"], "rtt_ms": [[0, 20, 40], [20, 0, 60], [40, 60, 0]],
                 "bandwidth_mbit": {"h0": 100}}


def test_json_file_of_the_issue_loads_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(ISSUE_EXAMPLE))
    topology = Topology.from_file(path)
    assert topology.hosts == ("h0", "h1", "h2")
    assert topology.rtt("h1", "h2") == 60.0 and topology.bandwidth_mbit == {"h0": 100.0}
    assert topology.loss_pct is None
    again = Topology.from_json(topology.to_json())
    assert (again.hosts, again.rtt_ms, dict(again.bandwidth_mbit)) == (topology.hosts, topology.rtt_ms, {"h0": 100.0})


def test_scalar_loss_applies_to_every_pair() -> None:
    topology = Topology.from_dict({**ISSUE_EXAMPLE, "loss_pct": 2})
    assert topology.loss_pct is not None
    assert [topology.loss_pct[i][j] for i, j in itertools.permutations(range(3), 2)] == [2.0] * 6
    assert all(topology.loss_pct[i][i] == 0 for i in range(3))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rtt_ms": [[0, 20, 40], [21, 0, 60], [40, 60, 0]]}, "symmetric"),
        ({"rtt_ms": [[5, 20, 40], [20, 0, 60], [40, 60, 0]]}, "must be 0"),
        ({"rtt_ms": [[0, 20], [20, 0]]}, "3x3"),
        ({"rtt_ms": [[0, -1, 40], [-1, 0, 60], [40, 60, 0]]}, "outside"),
        ({"hosts": ["h0", "h0", "h2"]}, "unique"),
        ({"hosts": ["h0", "_hub", "h2"]}, "must match"),
        ({"bandwidth_mbit": {"h9": 10}}, "not a host"),
        ({"bandwidth_mbit": {"h0": 0}}, "positive"),
        ({"loss_pct": 100}, "[0, 100)"),
        ({"latency": 1}, "unknown topology keys"),
    ],
)
def test_invalid_specs_are_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Topology.from_dict({**ISSUE_EXAMPLE, **change})


def test_csv_matrix_and_edge_list_give_the_same_topology(tmp_path: Path) -> None:
    matrix = tmp_path / "m.csv"
    matrix.write_text("host,a,b,c\na,0,10,30\nb,10,0,25\nc,30,25,0\n")
    edges = tmp_path / "e.csv"
    edges.write_text("a,b,rtt_ms\na,b,10\nb,c,25\na,c,30\n")
    from_matrix, from_edges = Topology.from_file(matrix), Topology.from_file(edges)
    assert from_matrix.hosts == from_edges.hosts == ("a", "b", "c")
    assert from_matrix.rtt_ms == from_edges.rtt_ms
    edges.write_text("a,b,rtt_ms\na,b,10\nb,c,25\n")
    with pytest.raises(TopologyError, match="no RTT"):
        Topology.from_file(edges)


def test_uniform_generator_is_seeded_and_in_range() -> None:
    first, again, other = (uniform(6, min_ms=5, max_ms=80, seed=s) for s in (3, 3, 4))
    assert first.rtt_ms == again.rtt_ms and first.rtt_ms != other.rtt_ms
    values = [first.rtt_ms[i][j] for i, j in itertools.combinations(range(6), 2)]
    assert all(5 <= value <= 80 for value in values) and len(set(values)) == len(values)


def test_random_geometric_generator_obeys_the_triangle_inequality() -> None:
    topology = random_geometric(8, min_ms=2, max_ms=90, seed=7)
    rtt = topology.rtt_ms
    for i, j, k in itertools.permutations(range(8), 3):
        assert rtt[i][k] <= rtt[i][j] + rtt[j][k] + 1e-6
    assert random_geometric(8, min_ms=2, max_ms=90, seed=7).rtt_ms == rtt
    assert constant(("a", "b"), 20).rtt_ms == ((0.0, 20.0), (20.0, 0.0))
    assert constant(("a", "b"), 20).bandwidth_mbit == {}
    assert constant(("a", "b"), 20, mbit=100).bandwidth_mbit == {"a": 100, "b": 100}


@pytest.mark.skipif(not RIPE_DATA.is_file(), reason=f"RIPE Atlas data missing at {RIPE_DATA}")
def test_ripe_matrix_is_the_papers_derivation() -> None:
    topology = ripe.from_ripe_atlas(5, seed=0, path=RIPE_DATA)
    assert "derived from RIPE Atlas" in topology.source
    anchors = {f"a{anchor.anchor_id}": anchor for anchor in ripe.load_anchors(RIPE_DATA)}
    assert len(anchors) == 320
    a, b = (anchors[host] for host in topology.hosts[:2])
    expected = 0.3 * a.median_rtt_ms + 0.3 * b.median_rtt_ms + 0.01 * ripe.great_circle_km(a, b)
    assert topology.rtt_ms[0][1] == pytest.approx(expected, abs=1e-3)
    # Amsterdam to Frankfurt is about 365 km on the great circle.
    amsterdam = ripe.Anchor(1, 0, 52.37, 4.90)
    frankfurt = ripe.Anchor(2, 0, 50.11, 8.68)
    assert ripe.great_circle_km(amsterdam, frankfurt) == pytest.approx(365, rel=0.02)
    named = ripe.from_ripe_atlas(5, seed=0, path=RIPE_DATA, hosts=["dht", "s0", "s1", "s2", "client"])
    assert named.rtt_ms == topology.rtt_ms


def run_out(schedule: Schedule[int], now_ns: float = math.inf) -> dict[int, int]:
    """Gives packet number -> delivery time (ns) of every packet due by `now_ns`, in the order they come out."""
    delivered = {}
    while (due := schedule.pop_due(now_ns)) is not None:
        delivered[due[1]] = due[0]
    return delivered


def test_schedule_delays_half_the_rtt_each_way() -> None:
    schedule: Schedule[int] = Schedule([[0, 20], [20, 0]], [None, None])
    forward, back = schedule.links[0][1], schedule.links[1][0]
    assert schedule.send(forward, 100, 1_000, 0) and schedule.send(back, 100, 5_000, 1)
    assert schedule.next_ns() == 1_000 + 10 * NS_PER_MS
    assert run_out(schedule, 1_000 + 10 * NS_PER_MS) == {0: 1_000 + 10 * NS_PER_MS}  # the other is not due yet
    assert run_out(schedule) == {1: 5_000 + 10 * NS_PER_MS} and len(schedule) == 0


def test_token_bucket_paces_a_backlog_at_the_rate() -> None:
    schedule: Schedule[int] = Schedule([[0, 0], [0, 0]], [8.0, None])  # 8 Mbit/s = 1000 bytes per ms
    link = schedule.links[0][1]
    assert all(schedule.send(link, 1000, 0, number) for number in range(100))  # 100 kB arriving at once
    delivered = run_out(schedule)
    times = [delivered[number] for number in range(100)]
    spacing_ms = (times[-1] - times[50]) / 49 / NS_PER_MS  # after the initial burst
    assert spacing_ms == pytest.approx(1.0, rel=1e-6)
    assert times[:3] == [0, 0, 0]  # the bucket starts full: a small burst goes at once


def test_full_queue_drops_instead_of_growing_without_bound() -> None:
    schedule: Schedule[int] = Schedule([[0, 0], [0, 0]], [8.0, None])  # queue limit 200 ms: ~200 packets of 1 kB
    link = schedule.links[0][1]
    carried = [schedule.send(link, 1000, 0, number) for number in range(400)]
    assert 190 <= sum(carried) <= 215
    assert schedule.dropped_queue == carried.count(False)
    assert sorted(run_out(schedule)) == [number for number, ok in enumerate(carried) if ok]


def test_downlink_limit_applies_to_what_a_host_receives() -> None:
    schedule: Schedule[int] = Schedule([[0, 10, 10], [10, 0, 10], [10, 10, 0]], [None, None, 4.0])  # h2: 500 B/ms
    for number in range(60):
        schedule.send(schedule.links[number % 2][2], 1000, 0, number)
    schedule.send(schedule.links[0][1], 1000, 0, 60)
    delivered = run_out(schedule)
    assert (delivered[59] - delivered[30]) / 29 / NS_PER_MS == pytest.approx(2.0, rel=1e-6)
    assert delivered[60] == 5 * NS_PER_MS  # other pairs are not slowed


def test_downlink_admits_packets_in_the_order_they_reach_it() -> None:
    # h2 receives 1000 B/ms from a far h0 (80 ms one way) and a near h1 (5 ms one way).
    schedule: Schedule[int] = Schedule([[0, 10, 160], [10, 0, 10], [160, 10, 0]], [None, None, 8.0])
    far, near = schedule.links[0][2], schedule.links[1][2]
    assert schedule.send(far, 1500, 0, 0) and schedule.send(near, 1500, 1 * NS_PER_MS, 1)
    delivered = run_out(schedule)
    assert 6 * NS_PER_MS <= delivered[1] <= 6 * NS_PER_MS + 1.5 * NS_PER_MS  # its half RTT, not behind the far one
    assert 80 * NS_PER_MS <= delivered[0] <= 80 * NS_PER_MS + 1.5 * NS_PER_MS


def test_packets_of_a_pair_stay_in_order_when_the_delay_drops() -> None:
    schedule: Schedule[int] = Schedule([[0, 80], [80, 0]], [None, None])
    link = schedule.links[0][1]
    schedule.send(link, 100, 0, 0)
    schedule.update([[0, 2], [2, 0]], [None, None])
    schedule.send(link, 100, 1 * NS_PER_MS, 1)
    schedule.send(link, 100, 50 * NS_PER_MS, 2)
    delivered = run_out(schedule)
    assert delivered[0] == 40 * NS_PER_MS and delivered[1] == delivered[0]  # held back, not reordered
    assert delivered[2] == 51 * NS_PER_MS


@pytest.mark.parametrize("later_mbit", [8.0, None])
def test_packets_of_a_pair_stay_in_order_through_a_limited_downlink(later_mbit: float | None) -> None:
    schedule: Schedule[int] = Schedule([[0, 80], [80, 0]], [None, 8.0])
    link = schedule.links[0][1]
    for number in range(5):
        schedule.send(link, 1000, number, number)
    schedule.update([[0, 2], [2, 0]], [None, later_mbit])  # later packets would overtake the first five
    for number in range(5, 10):
        schedule.send(link, 1000, 1 * NS_PER_MS + number, number)
    delivered = run_out(schedule)  # in the order the fabric would write them
    assert list(delivered) == list(range(10))
    assert list(delivered.values()) == sorted(delivered.values())


def test_loss_drops_about_the_configured_share_reproducibly() -> None:
    def dropped(seed: int) -> int:
        schedule: Schedule[int] = Schedule([[0, 10], [10, 0]], [None, None], [[0, 25], [25, 0]], seed=seed)
        return sum(not schedule.send(schedule.links[0][1], 100, t, t) for t in range(4000))

    assert dropped(1) == dropped(1)
    assert 900 <= dropped(1) <= 1100


def test_ping_json_has_null_for_a_pair_without_samples() -> None:
    measurement = RttMeasurement(("a", "b", "c"), [[0, 10, 20], [10, 0, 30], [20, 30, 0]],
                                 [[0, 10.2, math.nan], [10.2, 0, 0], [math.nan, 0, 0]], "udp", {(0, 1): [10.2],
                                                                                                (0, 2): []})
    text = json.dumps(measurement.to_json(), allow_nan=False)
    assert json.loads(text)["measured_ms"][0] == [0, 10.2, None]
    assert [line.split(":")[0] for line in measurement.failures()] == ["a-c"]


def test_tc_builder_gives_per_destination_netem_classes() -> None:
    topology = Topology(("h0", "h1", "h2"), [[0, 20, 40], [20, 0, 60], [40, 60, 0]], {"h0": 100},
                        [[0, 1.5, 0], [1.5, 0, 0], [0, 0, 0]])
    layout = Layout("abc", topology.hosts, Path("/nonexistent"))
    tc = ["tc", "-n", "csnet-abc-h0"]
    assert host_commands(layout, topology, 0) == [
        [*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "2"],
        [*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "100mbit", "ceil",
         "100mbit"],
        [*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid", "1:2", "htb", "rate", "100mbit", "ceil",
         "100mbit"],
        [*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid", "1:11", "htb", "rate", "100mbit", "ceil",
         "100mbit"],
        [*tc, "qdisc", "add", "dev", "eth0", "parent", "1:11", "handle", "11:", "netem", "delay", "10000us", "loss",
         "1.5%", "limit", "100000"],
        [*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
         "dst", "10.77.0.2/32", "flowid", "1:11"],
        [*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid", "1:12", "htb", "rate", "100mbit", "ceil",
         "100mbit"],
        [*tc, "qdisc", "add", "dev", "eth0", "parent", "1:12", "handle", "12:", "netem", "delay", "20000us", "limit",
         "100000"],
        [*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
         "dst", "10.77.0.3/32", "flowid", "1:12"],
    ]
    h2 = host_commands(layout, topology, 2)
    assert h2[1][-4:] == ["rate", "10gbit", "ceil", "10gbit"]  # no limit on h2
    assert ["tc", "-n", "csnet-abc-h2", "qdisc", "add", "dev", "eth0", "parent", "1:11", "handle", "11:", "netem",
            "delay", "30000us", "limit", "100000"] in h2


def test_tc_update_changes_delays_and_limits_in_place() -> None:
    topology = Topology(("h0", "h1"), [[0, 7.5], [7.5, 0]], {"h1": 8})
    layout = Layout("abc", topology.hosts, Path("/nonexistent"))
    commands = update_commands(layout, topology)
    assert ["tc", "-n", "csnet-abc-h0", "qdisc", "change", "dev", "eth0", "parent", "1:11", "handle", "11:",
            "netem", "delay", "3750us", "limit", "100000"] in commands
    assert ["tc", "-n", "csnet-abc-_hub", "qdisc", "replace", "dev", "v1", "root", "tbf", "rate", "8mbit", "burst",
            "15140", "latency", "200ms"] in commands
    assert netem_args(topology, 1, 0)[:3] == ["netem", "delay", "3750us"]
    assert not any("v0" in command for command in commands)  # h0 has no downlink limit
    assert math.isclose(topology.rtt("h0", "h1"), 7.5)


def test_tc_update_removes_a_downlink_limit_the_topology_no_longer_has() -> None:
    limited = Topology(("h0", "h1"), [[0, 7.5], [7.5, 0]], {"h0": 20, "h1": 8})
    layout = Layout("abc", limited.hosts, Path("/nonexistent"))
    assert downlink_removals(layout, limited) == []
    unlimited = Topology(("h0", "h1"), [[0, 7.5], [7.5, 0]], {"h0": 20})
    assert downlink_removals(layout, unlimited) == [["tc", "-n", "csnet-abc-_hub", "qdisc", "del", "dev", "v1", "root"]]
    commands = update_commands(layout, unlimited)
    assert not any("v1" in command for command in commands)  # no tbf is put back on h1's downlink
    assert ["tc", "-n", "csnet-abc-h1", "class", "change", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb",
            "rate", "10gbit", "ceil", "10gbit"] in commands  # nor a limit on its uplink


def test_tc_backend_runs_the_removals_without_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[list[str], bool]] = []
    monkeypatch.setattr(netns, "run", lambda argv, *, check=True: ran.append((list(argv), check)) or "")
    topology = Topology(("h0", "h1"), [[0, 7.5], [7.5, 0]], {"h0": 20})
    TcBackend(Layout("abc", topology.hosts, Path("/nonexistent"))).update(topology)
    assert [argv for argv, check in ran if not check] == [["tc", "-n", "csnet-abc-_hub", "qdisc", "del", "dev", "v1",
                                                           "root"]]
    assert len(ran) > 1 and all(check for argv, check in ran if "del" not in argv)
