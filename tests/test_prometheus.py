"""The Prometheus endpoint: heartbeats -> metric families (areal_bus/runtime/prometheus.py, fed by the probe's
view), and the probe node serving them on loopback while a real system runs.

The unit tests build heartbeats by hand, encode them as nodes do and scrape the collector through
prometheus_client's own exposition and parser (no sockets). The system test starts the bus, agent,
one rollout worker, reward, trainer, weights and a probe node as `areal-bus node` processes on
simulated engines, scrapes http://127.0.0.1:<port>/metrics twice and checks what a Prometheus user
reads: the families and their node/kind labels, and counters that grow while the run goes on.

Run: .venv/bin/python -m pytest -q tests/test_prometheus.py      (the system test is marked slow, ~30 s)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder, decode
from areal_bus.runtime.metrics import Metrics
from areal_bus.config.node_configs import ProbeConfig
from areal_bus.runtime.prometheus import HeartbeatCollector
from areal_bus.config.topology import Topology
from nodes.probe import ProbeView

REPO = Path(__file__).resolve().parents[1]


# -- the mapping, from synthetic heartbeats ------------------------------------------------------------

def _hb(node_id: str, t: float, metrics: Metrics, version: int = 3, incarnation: str = "a") -> m.Heartbeat:
    """A heartbeat as a node sends it (snapshot, encoded, decoded), so wire types are what the probe gets."""
    counters, gauges, hists = metrics.snapshot()
    hb = m.Heartbeat(node_id=node_id, kind=node_id.rpartition("-")[0], incarnation=incarnation, pid=1, t=t,
                     version=version, counters=counters, gauges=gauges, hists=hists)
    return decode(Encoder(node_id + "/hb").encode(hb))[1]


def _scrape(view: ProbeView, now: float, dead_after: float = 2.0) -> dict:
    """{family name: family} as a Prometheus server would parse the exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeartbeatCollector(lambda: view.samples(now, dead_after)))
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    found = [s.value for s in fams[family].samples
             if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, sample, labels, fams[family].samples)
    return found[0]


def _system_view() -> ProbeView:
    trainer, rollout, gateway = Metrics(), Metrics(), Metrics()
    for name, by in (("samples", 40), ("tokens", 9_000), ("busy_seconds", 1.5), ("stale_dropped", 3),
                     ("duplicates", 1), ("dropped.bad_msgpack", 2)):
        trainer.inc(name, by)
    trainer.observe("staleness", 0, 30)
    trainer.observe("staleness", 2, 10)
    trainer.gauge("queue.buffered", 12)
    trainer.gauge("busy", 1.0)
    rollout.inc("samples", 50)
    rollout.inc("tokens", 11_000)
    rollout.gauge("queue.waiting_version", 2)
    for reason in ("queue_full", "queue_full", "invalid_api_key"):
        gateway.inc("http.rejected")
        gateway.inc(f"http.rejected.{reason}")
    for seconds in (0.004, 0.2, 0.2, 3.0, 500.0):
        gateway.observe_seconds("gateway.latency_seconds", seconds)
    gateway.gauge("http.pending", 5)
    view = ProbeView()
    view.add(_hb("trainer-0", 100.0, Metrics()), now=100.0)  # the busy fraction's window starts at 0
    for node_id, metrics in (("trainer-0", trainer), ("rollout-0", rollout), ("gateway-0", gateway)):
        view.add(_hb(node_id, 102.0, metrics), now=102.0)
    return view


def test_heartbeat_counters_are_prometheus_counters_labelled_by_node_and_kind():
    fams = _scrape(_system_view(), now=102.0)
    assert fams["areal_bus_samples"].type == "counter"
    assert _value(fams, "areal_bus_samples", node="trainer-0", kind="trainer") == 40
    assert _value(fams, "areal_bus_samples", node="rollout-0", kind="rollout") == 50
    assert _value(fams, "areal_bus_tokens", node="rollout-0") == 11_000
    assert _value(fams, "areal_bus_busy_seconds", node="trainer-0") == 1.5
    assert _value(fams, "areal_bus_stale_dropped", node="trainer-0") == 3
    assert _value(fams, "areal_bus_duplicates", node="trainer-0") == 1
    assert _value(fams, "areal_bus_dropped_frames", node="trainer-0", reason="bad_msgpack") == 2


def test_trainer_busy_fraction_is_a_gauge_over_the_probe_window():
    fams = _scrape(_system_view(), now=102.0)
    assert _value(fams, "areal_bus_busy_fraction", node="trainer-0") == 0.75  # 1.5 busy s in 2 s


def test_staleness_is_a_cumulative_histogram_with_a_bucket_per_version():
    fams = _scrape(_system_view(), now=102.0)
    assert fams["areal_bus_staleness"].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fams["areal_bus_staleness"].samples if s.name.endswith("_bucket")}
    assert buckets == {"0.0": 30, "1.0": 30, "2.0": 40, "+Inf": 40}
    assert _value(fams, "areal_bus_staleness", "areal_bus_staleness_count") == 40
    assert _value(fams, "areal_bus_staleness", "areal_bus_staleness_sum") == 20  # 10 samples 2 versions old


def test_gateway_latency_histogram_keeps_its_edges_and_sum():
    fams = _scrape(_system_view(), now=102.0)
    samples = fams["areal_bus_gateway_latency_seconds"].samples
    le = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert le["0.005"] == 1 and le["0.25"] == 3 and le["5.0"] == 4 and le["120.0"] == 4 and le["+Inf"] == 5
    assert len(le) == 15  # every edge, empty ones too: the same series at every scrape
    total = _value(fams, "areal_bus_gateway_latency_seconds", "areal_bus_gateway_latency_seconds_sum")
    assert total == pytest.approx(503.404)
    assert "areal_bus_gateway_latency_seconds_sum" not in {f for f in fams}  # no stray counter of the sum


def test_gateway_refusals_are_counted_by_reason_without_their_sum():
    fams = _scrape(_system_view(), now=102.0)
    assert _value(fams, "areal_bus_http_rejected", reason="queue_full", node="gateway-0", kind="gateway") == 2
    assert _value(fams, "areal_bus_http_rejected", reason="invalid_api_key") == 1
    assert len(fams["areal_bus_http_rejected"].samples) == 2  # http.rejected (their sum) is not a series


def test_queue_depths_share_one_family_labelled_by_queue():
    fams = _scrape(_system_view(), now=102.0)
    assert _value(fams, "areal_bus_queue_depth", node="trainer-0", queue="queue.buffered") == 12
    assert _value(fams, "areal_bus_queue_depth", node="rollout-0", queue="queue.waiting_version") == 2
    assert _value(fams, "areal_bus_queue_depth", node="gateway-0", queue="http.pending") == 5


def test_every_node_has_up_last_seen_and_version_and_a_silent_one_is_down():
    view = _system_view()
    view.add(_hb("reward-0", 95.0, Metrics()), now=95.0)  # silent since
    fams = _scrape(view, now=102.0, dead_after=2.0)
    assert _value(fams, "areal_bus_node_up", node="trainer-0") == 1
    assert _value(fams, "areal_bus_node_up", node="reward-0", kind="reward") == 0
    assert _value(fams, "areal_bus_node_last_seen_timestamp_seconds", node="reward-0") == 95.0
    assert _value(fams, "areal_bus_policy_version", node="rollout-0") == 3


def test_weight_swaps_are_timed_from_new_acks_only():
    view = ProbeView()
    view.add(_hb("rollout-0", 1.0, Metrics()), now=1.0)
    acks = [(4, 0.0), (4, 0.0), (5, 0.03), (5, 0.0), (6, 0.2)]  # first: where it stands; repeats: no swap
    for version, took in acks:
        view.add_ack(m.VersionAck(node_id="rollout-0", version=version, switch_seconds=took, lineage="L"))
    view.add_ack(m.VersionAck(node_id="rollout-0", version=0, switch_seconds=0.1, lineage="L2"))  # new lineage
    fams = _scrape(view, now=1.0)
    name = "areal_bus_weight_swap_seconds"
    assert _value(fams, name, name + "_count", node="rollout-0", kind="rollout") == 3
    assert _value(fams, name, name + "_sum") == pytest.approx(0.33)
    assert _value(fams, name, name + "_bucket", le="0.05") == 1


def test_trainer_drop_counters_are_series_before_the_first_drop():
    view = ProbeView()
    view.add(_hb("trainer-0", 1.0, Metrics()), now=1.0)
    fams = _scrape(view, now=1.0)
    assert _value(fams, "areal_bus_stale_dropped", node="trainer-0") == 0
    assert _value(fams, "areal_bus_duplicates", node="trainer-0") == 0


def test_a_wild_histogram_value_costs_one_bucket_not_one_per_value():
    view = ProbeView()
    view.add(_hb("trainer-0", 1.0, Metrics()), now=1.0)
    view.last["trainer-0"].hists["staleness"] = {"0": 3.0, "1000000000": 1.0, "nan": 1.0}
    buckets = [s for s in _scrape(view, now=1.0)["areal_bus_staleness"].samples if s.name.endswith("_bucket")]
    assert [(s.labels["le"], s.value) for s in buckets] == [("0.0", 3), ("1e+09", 4), ("+Inf", 5)]


def test_a_restarted_node_reads_as_a_counter_reset():
    view = ProbeView()
    before, after = Metrics(), Metrics()
    before.inc("samples", 900)
    after.inc("samples", 5)
    view.add(_hb("reward-0", 10.0, before, incarnation="old"), now=10.0)
    view.add(_hb("reward-0", 11.0, after, incarnation="new"), now=11.0)
    assert _value(_scrape(view, now=11.0), "areal_bus_samples", node="reward-0") == 5  # rate() sees a reset


@pytest.mark.timeout(60)
def test_a_served_gateway_request_lands_in_the_latency_histogram():
    from tests.test_gateway_openai import ScriptedBackend, Server

    server = Server(backend=ScriptedBackend(["Higher.", "Lower."], delay_s=0.02))
    try:
        client = server.client()
        for _ in range(2):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Guess."}])
        with pytest.raises(openai.AuthenticationError):  # a refusal is counted by reason, not timed
            server.client(key="wrong-key").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Guess."}])
        metrics = server.gateway.metrics
    finally:
        server.close()
    view = ProbeView()
    view.add(_hb("gateway-0", 1.0, metrics), now=1.0)
    fams = _scrape(view, now=1.0)
    name = "areal_bus_gateway_latency_seconds"
    assert _value(fams, name, name + "_count", node="gateway-0", kind="gateway") == 2
    assert _value(fams, name, name + "_bucket", le="0.01") == 0  # each waited 20 ms on the policy
    assert _value(fams, name, name + "_sum") >= 0.04
    assert _value(fams, "areal_bus_http_rejected", reason="invalid_api_key") == 1


def test_probe_config_is_the_topology_schema_of_nodes_probe_config():
    topo = Topology.model_validate({"nodes": {"probe": {"config": {"metrics_port": 0}}}})
    assert topo.nodes.probe.config == ProbeConfig(metrics_port=0)
    assert Topology().nodes.probe.config.metrics_host == "127.0.0.1"  # loopback unless asked
    with pytest.raises(ValidationError, match="metrics_prot"):
        Topology.model_validate({"nodes": {"probe": {"config": {"metrics_prot": 9401}}}})


# -- the probe node serving a running system -------------------------------------------------------

def _venv_bin() -> Path:
    here = Path(sys.executable).parent
    return here if (here / "areal-bus").exists() else REPO / ".venv" / "bin"


NODES = [("bus", 0), ("trainer", 0), ("weights", 0), ("reward", 0), ("rollout", 0), ("agent", 0), ("probe", 0)]


def _topology(ipc_dir: Path) -> dict:
    """topology/default.yaml on simulated engines, seconds per update, with the probe on a free port."""
    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data.update(
        name="promtest", rollout_workers=1, staleness_threshold=2, queue_max_size=64, trigger_batch_size=4,
        global_batch_size=8, mini_batch_size=4, max_steps=1_000_000,
        logging={"log_dir": "logs", "log_interval": 2, "save_interval": 0},
        agent={"framework": "sim", "max_turns": 1, "reward_source": "rule", "prompt_len": 16},
        rollout_engine={"kind": "sim", "max_batch": 8, "decode_step_s": 0.004, "decode_step_per_seq_s": 0.00001,
                        "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 16, "max": 48}},
        trainer_engine={"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.01},
        endpoints={"transport": "ipc", "ipc_dir": str(ipc_dir)},
        nodes={"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {},
               "probe": {"config": {"metrics_port": 0}}},
    )
    return data


@pytest.fixture
def running_nodes():
    """The nodes as `areal-bus node` processes in a short temp dir (ipc paths stay under ~107 bytes);
    each is stopped by its own pid with SIGTERM, then SIGKILL if it hangs."""
    root = Path(tempfile.mkdtemp(prefix="abp-", dir="/tmp"))
    topo = root / "topology.yaml"
    topo.write_text(yaml.safe_dump(_topology(root / "ipc")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        for kind, replica in NODES:
            out = open(root / f"{kind}-{replica}.out", "wb")
            procs.append(subprocess.Popen([str(_venv_bin() / "areal-bus"), "node", kind, "--topology", str(topo),
                                           "--replica", str(replica)], cwd=root, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            out.close()
        yield root, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if os.environ.get("KEEP_SYSTEM_DIR"):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _wait_for(pred, timeout: float, what: str, procs: list, root: Path):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        dead = [p.args[2] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            outs = "\n".join(f"-- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(root.glob("*.out")))
            raise AssertionError(f"{'nodes exited: ' + str(dead) if dead else f'timed out after {timeout:.0f}s'} "
                                 f"waiting for {what}\n{outs}")
        time.sleep(0.3)


def _http_families(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _series(fams: dict, family: str, sample: str | None = None) -> dict[str, float]:
    """{node: value} of one family's samples (those named ``sample``, if given)."""
    if family not in fams:
        return {}
    return {s.labels["node"]: s.value for s in fams[family].samples if sample is None or s.name == sample}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_probe_node_serves_prometheus_metrics_that_grow_while_the_system_runs(running_nodes):
    root, procs = running_nodes
    url_file = _wait_for(lambda: next(root.joinpath("logs").rglob("probe-0.metrics_url"), None), 90,
                         "the probe to write its metrics address", procs, root)
    url = url_file.read_text().strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url  # loopback by default

    def trained():
        # Every producer's counter in the first scrape too: the agent's and rollout's heartbeats may
        # report their first samples a beat after the trainer has already trained some.
        fams = _http_families(url)
        samples = _series(fams, "areal_bus_samples", "areal_bus_samples_total")
        return fams if all(samples.get(n) for n in ("trainer-0", "rollout-0", "agent-0")) else None

    first = _wait_for(trained, 90, "the trainer's, rollout's and agent's samples in a scrape", procs, root)
    time.sleep(3)
    second = _http_families(url)

    up = _series(second, "areal_bus_node_up")
    expected = ["bus-0", "agent-0", "rollout-0", "reward-0", "trainer-0", "weights-0"]
    assert {node: up.get(node) for node in expected} == dict.fromkeys(expected, 1.0), up
    kinds = {s.labels["node"]: s.labels["kind"] for s in second["areal_bus_node_up"].samples}
    assert kinds["rollout-0"] == "rollout" and kinds["trainer-0"] == "trainer", kinds

    # Counters, so that rate() is samples/s and tokens/s per node: they grow between two scrapes.
    for node in ("trainer-0", "rollout-0", "agent-0"):
        before = _series(first, "areal_bus_samples", "areal_bus_samples_total")[node]
        after = _series(second, "areal_bus_samples", "areal_bus_samples_total")[node]
        assert after > before, (node, before, after)
    assert second["areal_bus_tokens"].type == "counter"
    assert _series(second, "areal_bus_tokens", "areal_bus_tokens_total")["rollout-0"] > \
        _series(first, "areal_bus_tokens", "areal_bus_tokens_total")["rollout-0"]
    assert _series(second, "areal_bus_busy_seconds", "areal_bus_busy_seconds_total")["trainer-0"] > \
        _series(first, "areal_bus_busy_seconds", "areal_bus_busy_seconds_total")["trainer-0"]
    assert 0 < _series(second, "areal_bus_busy_fraction")["trainer-0"] <= 1

    # The trainer's staleness histogram, never past the bound; its queue depth; its drops and duplicates.
    stale = second["areal_bus_staleness"]
    assert stale.type == "histogram"
    count = _series(second, "areal_bus_staleness", "areal_bus_staleness_count")["trainer-0"]
    assert count > 0
    assert all(float(s.labels["le"]) <= 2 for s in stale.samples if s.name.endswith("_bucket") and s.value < count)
    assert any(s.labels.get("queue") == "queue.buffered" for s in second["areal_bus_queue_depth"].samples)
    assert _series(second, "areal_bus_stale_dropped", "areal_bus_stale_dropped_total")["trainer-0"] >= 0
    assert _series(second, "areal_bus_duplicates", "areal_bus_duplicates_total")["trainer-0"] >= 0

    # Weight swaps, timed from the rollout worker's acks of new versions.
    swaps = _series(second, "areal_bus_weight_swap_seconds", "areal_bus_weight_swap_seconds_count")
    assert swaps.get("rollout-0", 0) > 0, swaps
