"""The model router against a real local stand-in upstream (an aiohttp server on a random loopback
port) that answers 200, 401, 404, 429, 500, error bodies and slow replies; the router config's key
handling; and the reward node's judge and reward_model sources built on it.

Run: .venv/bin/pytest tests/test_router.py -q
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time

import pytest
import structlog
from aiohttp import web

from areal_bus.runtime.logs import render_line
from areal_bus.router import ModelRouter, RouterConfigError, RouterError, load_router_config, parse_router_config

pytestmark = pytest.mark.timeout(30)

KEY = "sk-standin-7f3a9c2e1b"
KEY_ENV = "AREAL_BUS_TEST_KEY"
SLOW_S = 1.0


class StandIn:
    """An OpenAI-compatible upstream whose behaviour is picked by the request's model id:

    ok / judge-ok: 200 (the reply echoes temperature and max_tokens); judge-mute: 200, no number;
    missing: 404 unknown model; ratelimited: 429 (Retry-After: 1) once, then 200; flaky: 500 once,
    then 200; broken: 500 always; nochoices: 200 with an error body; slow: 200 after SLOW_S.
    A wrong key gets 401 with the key echoed back, as some providers do."""

    def __init__(self):
        self.calls: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.models_reply = (200, {"object": "list", "data": [{"id": "ok", "object": "model"}]})

    def start(self) -> "StandIn":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(5)
        return self

    async def _start(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def calls_for(self, model: str) -> list[dict]:
        return [c for c in self.calls if c["model"] == model]

    async def _models(self, request):
        status, body = self.models_reply
        return web.json_response(body, status=status)

    async def _chat(self, request):
        body = await request.json()
        model = body.get("model")
        self.calls.append({"model": model, "t": time.monotonic(), "body": body})
        n = len(self.calls_for(model))
        auth = request.headers.get("Authorization", "")
        if auth != f"Bearer {KEY}":
            return web.json_response({"error": {"message": f"Incorrect API key provided: {auth[7:]}",
                                                "type": "invalid_request_error", "code": "invalid_api_key"}}, status=401)
        if model == "missing":
            return web.json_response({"error": {"message": "The model `missing` does not exist",
                                                "code": "model_not_found"}}, status=404)
        if model == "ratelimited" and n == 1:
            return web.json_response({"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "1"})
        if (model == "flaky" and n == 1) or model == "broken":
            return web.json_response({"error": {"message": "upstream exploded"}}, status=500)
        if model == "nochoices":
            return web.json_response({"error": {"message": "model overloaded, try later", "code": 1234}})
        if model == "slow":
            await asyncio.sleep(SLOW_S)
        content = {"judge-ok": "Score: 7. Found it in three guesses.",
                   "judge-mute": "I cannot grade this episode."}.get(
            model, f"hi from {model} t={body.get('temperature')} max={body.get('max_tokens')}")
        return web.json_response({"id": "cmpl-1", "object": "chat.completion", "model": model,
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def upstream():
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def router_yaml(base_url: str, *, key_ref: str = f"${{{KEY_ENV}}}", max_retries: int = 2, timeout: float = 5.0,
                policy: str = "ok", judge: str = "judge-ok", judge_timeout: float | None = None) -> str:
    judge_extra = f"\n    timeout: {judge_timeout}" if judge_timeout else ""
    return f"""
api_gateway:
  base_url: {base_url}
  api_key: {key_ref}
  timeout: {timeout}
  max_retries: {max_retries}
  retry_backoff_s: 0.05
model_routing:
  policy_model:
    model_id: {policy}
    temperature: 0.3
    max_tokens: 77
  judge_model:
    model_id: {judge}
    temperature: 0.0
    max_tokens: 16{judge_extra}
"""


def make_config(tmp_path, base_url, **kw):
    path = tmp_path / "router.yaml"
    path.write_text(router_yaml(base_url, **kw))
    return load_router_config(path)


def recording_log():
    """A logger rendering the real log lines into a buffer (as the gateway's log file would get them)."""
    buf = io.StringIO()
    return structlog.wrap_logger(structlog.PrintLogger(buf), processors=[render_line]).bind(_tag="gateway"), buf


def chat(cfg, model, request=None, log=None):
    """One request through a fresh router; returns (reply or RouterError, log text, seconds)."""
    log, buf = (log, None) if log else recording_log()
    request = request or {"messages": [{"role": "user", "content": "hi"}]}

    async def go():
        async with ModelRouter(cfg, log=log) as router:
            try:
                return await router.chat(model, request)
            except RouterError as err:
                return err

    t0 = time.monotonic()
    out = asyncio.run(go())
    text = buf.getvalue() if buf else ""
    assert KEY not in text, "the key leaked into the log"
    return out, text, time.monotonic() - t0


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- routing ---------------------------------------------------------------------------------------

def test_role_is_sent_as_its_model_id_with_the_route_defaults(upstream, key_env, tmp_path):
    reply, log, _ = chat(make_config(tmp_path, upstream.base_url), "policy_model")
    assert reply["choices"][0]["message"]["content"] == "hi from ok t=0.3 max=77"
    assert "routed role=policy_model model=ok status=200" in log and "retries=0" in log and " ms=" in log


def test_request_values_win_over_route_defaults_and_model_id_routes_like_its_role(upstream, key_env, tmp_path):
    reply, log, _ = chat(make_config(tmp_path, upstream.base_url), "ok",
                         {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.9})
    assert reply["choices"][0]["message"]["content"] == "hi from ok t=0.9 max=77"
    assert "role=policy_model" in log


def test_unknown_route_is_refused_locally_listing_the_known_ones(upstream, key_env, tmp_path):
    err, _, _ = chat(make_config(tmp_path, upstream.base_url), "reward_model")
    assert isinstance(err, RouterError) and err.kind == "unknown_model"
    assert "add model_routing.reward_model" in str(err)
    assert upstream.calls == []


# -- upstream failures -----------------------------------------------------------------------------

def test_401_names_the_three_key_checks_and_never_the_key(upstream, monkeypatch, tmp_path):
    monkeypatch.setenv(KEY_ENV, "sk-wrong-but-secret-42")
    err, log, _ = chat(make_config(tmp_path, upstream.base_url), "policy_model")
    assert isinstance(err, RouterError) and (err.kind, err.status) == ("unauthorized", 401)
    msg = str(err)
    # Unset, literal and whitespace were ruled out at load (their own messages, tested below), so
    # the 401 says what was verified and that the value itself is wrong.
    assert "401 Invalid API key" in msg and f"key from ${KEY_ENV}: set, 22 chars, no whitespace" in msg
    assert f"export {KEY_ENV}=<the gateway's key> in this shell" in msg and f"${{{KEY_ENV}}}" in msg
    assert "\n" not in msg
    # The stand-in echoes the key it was given, as some providers do: it is scrubbed everywhere.
    for text in (msg, err.body, log):
        assert "sk-wrong-but-secret-42" not in text
    assert "Authorization" not in log and "Bearer" not in log
    assert len(upstream.calls) == 1  # a 401 is not retried


def test_404_names_the_unknown_model_id_and_its_field_without_retrying(upstream, key_env, tmp_path):
    err, _, _ = chat(make_config(tmp_path, upstream.base_url, policy="missing"), "policy_model")
    assert (err.kind, err.status) == ("unknown_model", 404)
    assert "404 unknown model id 'missing'" in str(err) and "model_routing.policy_model.model_id" in str(err)
    assert len(upstream.calls) == 1


def test_429_waits_for_retry_after_then_succeeds_and_logs_the_retry(upstream, key_env, tmp_path):
    reply, log, _ = chat(make_config(tmp_path, upstream.base_url, policy="ratelimited"), "policy_model")
    assert reply["choices"]
    first, second = upstream.calls_for("ratelimited")
    assert second["t"] - first["t"] >= 0.95  # Retry-After: 1, though the backoff alone would be 0.05 s
    assert "retry role=policy_model model=ratelimited attempt=1 reason=429" in log
    assert "routed role=policy_model model=ratelimited status=200" in log and "retries=1" in log


def test_500_is_retried_then_succeeds(upstream, key_env, tmp_path):
    reply, log, _ = chat(make_config(tmp_path, upstream.base_url, policy="flaky"), "policy_model")
    assert reply["choices"] and len(upstream.calls_for("flaky")) == 2
    assert "reason=500" in log and "retries=1" in log


def test_500_forever_gives_up_after_max_retries_with_the_body(upstream, key_env, tmp_path):
    err, log, _ = chat(make_config(tmp_path, upstream.base_url, policy="broken", max_retries=2), "policy_model")
    assert (err.kind, err.status, err.retries) == ("upstream", 500, 2)
    assert len(upstream.calls_for("broken")) == 3
    assert "500 upstream error" in str(err) and "after 2 retries" in str(err) and "upstream exploded" in str(err)
    assert "route_failed role=policy_model model=broken status=500 kind=upstream" in log


def test_body_without_choices_is_shown(upstream, key_env, tmp_path):
    err, _, _ = chat(make_config(tmp_path, upstream.base_url, policy="nochoices"), "policy_model")
    assert (err.kind, err.status) == ("no_choices", 200)
    assert "has no 'choices'" in str(err)
    assert '{"error":{"message":"model overloaded, try later","code":1234}}' in str(err)
    assert len(upstream.calls) == 1


def test_slow_reply_times_out_per_model_override_and_is_retried(upstream, key_env, tmp_path):
    cfg = make_config(tmp_path, upstream.base_url, judge="slow", judge_timeout=0.2, max_retries=1)
    err, log, took = chat(cfg, "judge_model")
    assert (err.kind, err.status) == ("timeout", None)
    assert len(upstream.calls_for("slow")) == 2 and took < SLOW_S * 1.5
    assert "within 0.2 s on any of 2 attempts" in str(err) and "model_routing.judge_model.timeout" in str(err)
    assert "reason=timeout" in log


def test_closed_port_fails_at_once_naming_host_port_and_the_gateway_log(key_env, tmp_path):
    port = closed_port()
    err, _, took = chat(make_config(tmp_path, f"http://127.0.0.1:{port}/v1"), "policy_model")
    assert err.kind == "unreachable" and took < 2
    assert f"cannot reach 127.0.0.1:{port} (connection refused" in str(err)
    assert "logs/supervisor/gateway-0.log" in str(err) and "supervisorctl" in str(err)


def test_chat_sync_works_from_synchronous_code(upstream, key_env, tmp_path):
    log, buf = recording_log()
    router = ModelRouter(make_config(tmp_path, upstream.base_url), log=log)
    assert router.chat_sync("judge_model", {"messages": [{"role": "user", "content": "x"}]})["choices"]
    assert router.chat_sync("judge_model", {"messages": [{"role": "user", "content": "y"}]})["choices"]
    assert buf.getvalue().count("routed role=judge_model") == 2


# -- configuration ---------------------------------------------------------------------------------

def test_literal_key_is_refused_without_echoing_it(tmp_path):
    with pytest.raises(RouterConfigError) as exc:
        make_config(tmp_path, "http://127.0.0.1:9/v1", key_ref="sk-live-verysecret")
    assert "api_gateway.api_key: a literal API key is refused" in str(exc.value)
    assert "${AREAL_BUS_API_KEY}" in str(exc.value) and "sk-live-verysecret" not in str(exc.value)
    assert str(tmp_path / "router.yaml") in str(exc.value)


def test_key_reference_with_a_default_is_refused(tmp_path):
    with pytest.raises(RouterConfigError, match=r"must be exactly \$\{NAME\}") as exc:
        make_config(tmp_path, "http://127.0.0.1:9/v1", key_ref="${X:-sk-fallback-secret}")
    assert "sk-fallback-secret" not in str(exc.value)


def test_unset_key_variable_is_named_with_export_hint(monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RouterConfigError, match=rf"\${KEY_ENV} is not set in this shell: export {KEY_ENV}="):
        make_config(tmp_path, "http://127.0.0.1:9/v1")


def test_trailing_newline_in_key_is_flagged_without_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv(KEY_ENV, KEY + "\n")
    with pytest.raises(RouterConfigError) as exc:
        make_config(tmp_path, "http://127.0.0.1:9/v1")
    msg = str(exc.value)
    assert f"({len(KEY) + 1} chars) ends with a newline" in msg and "401" in msg and KEY not in msg


def test_bad_field_is_named_with_its_path(key_env, tmp_path):
    with pytest.raises(RouterConfigError, match=r"router.yaml: invalid router config: api_gateway.max_retries"):
        make_config(tmp_path, "http://127.0.0.1:9/v1", max_retries=-1)
    with pytest.raises(RouterConfigError, match=r"api_gateway.base_url: .*http\(s\) URL"):
        parse_router_config({"api_gateway": {"base_url": "127.0.0.1:9000", "api_key": f"${{{KEY_ENV}}}"}})


def test_example_config_loads_and_dumps_without_the_key(key_env, monkeypatch):
    monkeypatch.setenv("AREAL_BUS_API_KEY", KEY)
    cfg = load_router_config("configs/router.yaml")
    assert set(cfg.routes()) == {"policy_model", "reward_model", "judge_model"}
    assert cfg.model_routing.judge_model.timeout == 120
    dumped = json.dumps(cfg.model_dump(mode="json"))
    assert KEY not in dumped and "${AREAL_BUS_API_KEY}" in dumped and KEY not in repr(cfg)


# -- the reward node's judge and reward_model sources ----------------------------------------------

def _trajectory(make_traj=None):
    import numpy as np

    from areal_bus.wire import messages as m

    n = 4
    return m.Trajectory(traj_id="t1", episode_id="e1", ticket=0, worker="w", prompt_ids=np.arange(3, dtype=np.int32),
                        output_ids=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
                        versions=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                        meta={"task": "Guess the number in 1..16.", "transcript": "8? lower. 4? higher. 6! correct."})


def _reward_topology(tmp_path, config: dict):
    from areal_bus.config.topology import parse_topology

    # the source is agent.reward_source (one place); the judge's or reward model's settings stay with the node
    config = dict(config)
    agent = {"reward_source": config.pop("reward_source")}
    return parse_topology({"agent": agent, "nodes": {"reward": {"config": config}},
                           "logging": {"log_dir": str(tmp_path)}})


def test_judge_source_scores_through_the_router_with_the_rubric(upstream, key_env, tmp_path):
    from nodes.reward import make_scorer

    (tmp_path / "router.yaml").write_text(router_yaml(upstream.base_url))
    topo = _reward_topology(tmp_path, {"reward_source": "judge", "router_config": "router.yaml",
                                       "rubric": "Task: {task}\nEpisode: {transcript}\nScore 0-10 {json: braces}"})
    scorer = make_scorer(topo, base=tmp_path)
    assert scorer.source == "judge"
    assert scorer.score(_trajectory()).reward == pytest.approx(0.7)
    sent = upstream.calls_for("judge-ok")[0]["body"]
    assert sent["messages"][0]["content"] == ("Task: Guess the number in 1..16.\n"
                                              "Episode: 8? lower. 4? higher. 6! correct.\nScore 0-10 {json: braces}")
    assert sent["temperature"] == 0.0


def test_unparseable_judge_reply_scores_zero_and_is_counted(upstream, key_env, tmp_path):
    from nodes.reward import make_scorer

    (tmp_path / "router.yaml").write_text(router_yaml(upstream.base_url, judge="judge-mute"))
    scorer = make_scorer(_reward_topology(tmp_path, {"reward_source": "judge", "router_config": "router.yaml"}),
                         base=tmp_path)
    assert scorer.score(_trajectory()).reward == 0.0
    assert scorer.verifier.unparsed == 1
    assert "Score 0-10" in upstream.calls_for("judge-mute")[0]["body"]["messages"][0]["content"]  # default rubric


def test_parse_score_takes_the_first_number_and_normalises():
    from nodes.reward import parse_score

    assert parse_score("Score: 7/10") == pytest.approx(0.7)
    assert parse_score("12 out of 10") == 1.0 and parse_score("-3") == 0.0
    assert parse_score("no idea") is None


def test_rule_and_passthrough_are_unchanged():
    from areal_bus.config.topology import parse_topology
    from nodes.reward import make_scorer

    traj = _trajectory()
    rule = make_scorer(parse_topology({})).score(traj).reward
    assert 0 <= rule <= 1 and make_scorer(parse_topology({})).score(_trajectory()).reward == rule
    passthrough = make_scorer(parse_topology({"agent": {"reward_source": "passthrough"}}))
    assert passthrough.score(_trajectory()).reward is None


def test_reward_model_source_scores_sigmoid_of_a_local_classifier(tmp_path):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from nodes.reward import make_scorer

    tok = AutoTokenizer.from_pretrained("models/tiny-guess")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    model = Qwen2ForSequenceClassification(cfg).eval()
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    scorer = make_scorer(_reward_topology(tmp_path, {"reward_source": "reward_model", "model_path": "rm"}), base=tmp_path)
    reward = scorer.score(_trajectory()).reward
    traj = _trajectory()
    enc = tok(f"{traj.meta['task']}\n{traj.meta['transcript']}", return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(model(**enc).logits[0, 0]).item()
    assert 0 < reward < 1 and reward == pytest.approx(expected, abs=1e-5)
