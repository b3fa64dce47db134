"""RolloutCore without sockets: the weight swap between decode steps, which (lineage, version) it
adopts, reissued and version-gated requests, refusals and streams, each answered to the right place.

The swap, reissue, refusals and streams run the real torch engine on the shipped tiny model
(models/tiny-guess); version order and waiting run the simulated engine, whose tags follow the same rules."""

from pathlib import Path

import numpy as np

from areal_bus.wire import messages as m
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model.modeling import load_pretrained, make_random_model, save_pretrained
from areal_bus.config.topology import load_topology
from areal_bus.version import PolicyVersion
from nodes.rollout.core import ReplyTo, RolloutCore, StepLog
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-guess"
TOPO = load_topology(ROOT / "topology" / "sim.yaml")
PROMPT = [5, 9, 14, 3, 7]


def _req(rid, max_tokens=8, prompt=PROMPT, min_version=0, reply_to=0, stream=False):
    return m.GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=0, min_version=min_version,
                             max_tokens=max_tokens, temperature=0.0, prompt_ids=np.asarray(prompt, np.int32),
                             reply_to=reply_to, stream=stream)


def _announce(version, location="", lineage="L"):
    return m.VersionAnnounce(version=version, location=location, nbytes=0, published_at=0.0, lineage=lineage)


def _torch_engine(max_len=64):
    return TorchRolloutEngine(TINY, max_batch=4, max_len=max_len, eos_token_ids=[], worker="rollout-0")


def _sim_engine():
    return SimRolloutEngine(TOPO.rollout_engine.model_copy(update={"decode_step_s": 0.0, "swap_s": 0.0}),
                            "rollout-0")


def _core(engine, n_agents=1):
    return RolloutCore(engine, "rollout-0", n_agents, StepLog(TOPO))


def _step(core, done, n=1):
    """``n`` decode steps; finished requests go into ``done`` as {request_id: (ReplyTo, Completion)}."""
    for _ in range(n):
        done.update({comp.request_id: (to, comp) for to, comp in core.step()})


def _finish(core, done, limit=500):
    for _ in range(limit):
        if core.idle and not core.waiting:
            return done
        _step(core, done)
    raise AssertionError("did not finish")


def test_tokens_after_a_swap_between_decode_steps_carry_the_new_version_and_none_an_unserved_one(tmp_path):
    cfg = load_pretrained(TINY).cfg
    locations = {}
    for v in (1, 2, 3):
        locations[v] = str(tmp_path / f"v{v}")
        save_pretrained(make_random_model(cfg, seed=v, std=0.2), locations[v])
    core = _core(_torch_engine())
    for rid in ("a", "b"):
        assert core.on_request(_req(rid, max_tokens=12)) == []
    done = {}
    _step(core, done, 4)
    acks = core.on_hub([_announce(1, locations[1])])
    assert [(a.node_id, a.version, a.lineage) for a in acks] == [("rollout-0", 1, "L")] and acks[0].switch_seconds > 0
    assert core.serving == PolicyVersion("L", 1)
    core.on_request(_req("c", max_tokens=6))  # joins after the swap
    _step(core, done, 3)
    # Two versions announced within one safe point: the newest is served, the one between never is.
    assert [a.version for a in core.on_hub([_announce(2, locations[2]), _announce(3, locations[3])])] == [3]
    _finish(core, done)

    assert done["a"][1].versions.tolist() == [0] * 4 + [1] * 3 + [3] * 5
    assert done["b"][1].versions.tolist() == [0] * 4 + [1] * 3 + [3] * 5
    assert done["c"][1].versions.tolist() == [1] * 3 + [3] * 3
    assert {to for to, _ in done.values()} == {ReplyTo("agent", 0)}
    # The new weights really decode from the swap on: the same request without any swap matches
    # exactly up to it and not after it.
    alone = _core(_torch_engine())
    alone.on_request(_req("a", max_tokens=12))
    base = _finish(alone, {})["a"][1]
    np.testing.assert_allclose(done["a"][1].logprobs[:4], base.logprobs[:4], atol=1e-5)
    assert not np.allclose(done["a"][1].logprobs[4:], base.logprobs[4:], atol=1e-3)


def test_an_older_policy_is_never_adopted_and_a_new_lineage_with_a_lower_version_is():
    core = _core(_sim_engine())
    assert [(a.version, a.lineage) for a in core.on_hub([_announce(5, lineage="t1")])] == [(5, "t1")]
    # A late announce of an older version, and one of an older lineage with a higher number.
    acks = core.on_hub([_announce(3, lineage="t1"), _announce(9, lineage="t0")])
    assert core.serving == PolicyVersion("t1", 5) and core.engine.version == 5
    assert [(a.version, a.lineage) for a in acks] == [(5, "t1")]  # what it serves, acked again
    # A restarted trainer resumes from its checkpoint as a new lineage: its lower number is newer.
    acks = core.on_hub([_announce(2, lineage="t2")])
    assert [(a.version, a.lineage) for a in acks] == [(2, "t2")]
    assert core.serving == PolicyVersion("t2", 2) and core.engine.version == 2
    assert core.metrics.counters["weight_swaps"] == 2
    core.on_request(_req("a"))
    assert set(_finish(core, {})["a"][1].versions.tolist()) == {2}


def test_the_served_version_announced_again_is_acked_again_without_a_swap_and_silence_is_not():
    core = _core(_sim_engine())
    core.on_hub([_announce(1)])
    again = core.on_hub([m.Heartbeat(node_id="weights-0", kind="weights", incarnation="x", pid=1, t=0.0,
                                     version=1, counters={}, gauges={}, hists={}, inflight=[]), _announce(1)])
    assert [(a.version, a.lineage, a.switch_seconds) for a in again] == [(1, "L", 0.0)]
    assert core.on_hub([]) == []
    assert core.metrics.counters["weight_swaps"] == 1


def test_a_request_resent_while_the_worker_runs_it_is_not_run_twice():
    core = _core(_torch_engine(), n_agents=2)
    core.on_request(_req("a", max_tokens=10, reply_to=1))
    done = {}
    _step(core, done, 3)
    assert core.on_request(_req("a", max_tokens=10, reply_to=1)) == []  # reissued (a lost heartbeat)
    assert core.engine.running_ids == ["a"] and core.inflight == ["a"]
    finished = []
    for _ in range(50):
        finished += core.step()
    [(to, comp)] = finished
    assert to == ReplyTo("agent", 1) and comp.output_ids.size == 10 and not comp.error
    assert core.inflight == []


def test_a_request_above_the_served_version_waits_and_starts_once_that_version_arrives():
    core = _core(_sim_engine())
    free = core.engine.free_slots
    assert core.on_request(_req("w", min_version=2)) == [] and core.on_request(_req("w", min_version=2)) == []
    assert core.engine.running_ids == [] and core.inflight == ["w"]
    assert core.engine.free_slots == free and core.has_room == (free > 1)  # its slot is kept for it
    core.on_hub([_announce(1)])
    assert core.start_waiting() == [] and core.engine.running_ids == []
    core.on_hub([_announce(2)])
    assert core.start_waiting() == [] and core.engine.running_ids == ["w"] and core.waiting == []
    to, comp = _finish(core, {})["w"]
    assert to == ReplyTo("agent", 0) and set(comp.versions.tolist()) == {2}


def test_a_request_the_engine_refuses_is_answered_with_an_error_to_whoever_asked():
    core = _core(_torch_engine(max_len=16), n_agents=2)
    too_long = list(range(1, 17))  # no room left in a 16-position cache
    [(to, comp)] = core.on_request(_req("from-agent", prompt=too_long, reply_to=1))
    assert to == ReplyTo("agent", 1)
    assert (comp.request_id, comp.finish_reason, comp.output_ids.size) == ("from-agent", "error", 0)
    assert "prompt of 16 tokens" in comp.error
    [(to, comp)] = core.on_request(_req("from-gateway", prompt=too_long), gateway=0)
    assert to == ReplyTo("gateway", 0) and comp.error
    # One that waited for its version is refused when it would start, to its own gateway.
    assert core.on_request(_req("waited", prompt=too_long, min_version=1), gateway=1) == []
    core.on_hub([_announce(1)])
    [(to, comp)] = core.start_waiting()
    assert (to, comp.request_id, comp.finish_reason) == (ReplyTo("gateway", 1), "waited", "error")
    assert core.inflight == [] and core.metrics.counters["requests_refused"] == 3
    # Refused is answered, not remembered: the worker goes on serving, a resend included.
    assert len(core.on_request(_req("from-agent", prompt=too_long, reply_to=1))) == 1
    core.on_request(_req("fine", max_tokens=3, reply_to=1))
    to, comp = _finish(core, {})["fine"]
    assert to == ReplyTo("agent", 1) and comp.output_ids.size == 3 and not comp.error


def test_what_the_worker_cannot_answer_is_named_for_dropping():
    core = _core(_sim_engine(), n_agents=2)
    assert core.malformed(_announce(1)) == "wrong_type"
    assert core.malformed(_req("a", reply_to=2)) == "bad_reply_to"
    assert core.malformed(_req("a", reply_to=2), gateway=0) == ""  # a gateway's answer goes back to it
    assert core.malformed(_req("a", reply_to=1)) == ""


def test_a_streamed_gateway_request_reports_its_tokens_until_delivered_and_ends_with_the_completion():
    core = _core(_torch_engine())
    core.on_request(_req("s", max_tokens=4, stream=True), gateway=1)
    core.on_request(_req("agent-stream", max_tokens=4, stream=True))  # agents wait for the whole
    done = {}
    _step(core, done)
    [(j, part)] = core.partials()
    assert (j, part.request_id, part.start, part.output_ids.size) == (1, "s", 0, 1)
    core.reported(part, delivered=False)  # the gateway's queue was full
    _step(core, done)
    [(j, part)] = core.partials()
    assert (part.start, part.output_ids.size) == (0, 2)  # due again, with what came since
    core.reported(part, delivered=True)
    _finish(core, done)
    to, comp = done["s"]
    assert to == ReplyTo("gateway", 1) and comp.output_ids[:2].tolist() == part.output_ids.tolist()
    assert core.partials() == []
    assert core.metrics.counters["stream.partials"] == 1 and core.metrics.counters["stream.partials_dropped"] == 1


def test_step_log_writes_one_line_per_share_of_the_trigger_batch():
    log = StepLog(TOPO)
    assert log.every == TOPO.effective_trigger // TOPO.replicas("rollout")
    comp = m.Completion(request_id="a", episode_id="e", ticket=40, worker="w", output_ids=np.zeros(3, np.int32),
                        logprobs=np.zeros(3, np.float32), versions=np.zeros(3, np.int32))
    lines = [log.add(comp, version=1) for _ in range(2 * log.every)]
    assert [i for i, line in enumerate(lines) if line] == [log.every - 1, 2 * log.every - 1]
    assert lines[-1] == {"step": 40 // TOPO.effective_trigger, "generated": log.every, "tokens": 3 * log.every}


def test_step_log_step_is_the_update_the_samples_were_admitted_for_not_the_version_serving_them():
    # In gateway mode the serving version trails the update the samples are for by up to the staleness
    # bound; the step is read off the tickets alone, the highest so far (samples finish out of order).
    log = StepLog(TOPO)
    b = TOPO.effective_trigger

    def comp(ticket):
        return m.Completion(request_id="a", episode_id="e", ticket=ticket, worker="w", output_ids=np.zeros(1, np.int32),
                            logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32))

    lines = [log.add(comp(3 * b + 1 if i == 0 else b), version=9) for i in range(log.every)]
    assert lines[-1]["step"] == 3
    lines = [log.add(comp(0), version=9) for _ in range(log.every)]
    assert lines[-1]["step"] == 3
    lines = [log.add(comp(5 * b), version=1) for _ in range(log.every)]
    assert lines[-1]["step"] == 5
