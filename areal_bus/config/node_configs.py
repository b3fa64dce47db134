"""The per-node settings a topology holds under ``nodes.<kind>.config``, one schema per kind.

They live in the library, not next to their nodes, so that the topology schema (areal_bus/config/topology.py)
can validate them with the rest of the run's knobs: ``areal-bus validate`` names a bad
``nodes.gateway.config.port`` the way it names a bad ``staleness_threshold``. A kind that takes no
settings gets ``NoConfig``, which refuses every key (a typo is an error, not a silently ignored knob).

Paths in these configs (``router_config``, ``model_path``) are relative to the supervisord.conf's
folder, as every path in a topology is; ``Topology.resolve`` turns them into files.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from areal_bus.constants import HTTP_BODY_TIMEOUT_S, HTTP_HEADER_TIMEOUT_S


SECRET = "secret"
"""A field marked ``json_schema_extra={SECRET: True}`` holds a secret: ``topology.dump_resolved`` (the
config every node dumps at start, and `areal-bus validate` prints) shows REDACTED in its place."""
REDACTED = "<redacted>"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoConfig(_Strict):
    """``nodes.<kind>.config`` of a kind that takes no settings of its own (bus, agent, rollout, trainer,
    weights: their knobs are the topology's top-level fields)."""


class GatewayConfig(_Strict):
    """The gateway node's settings (``nodes.gateway.config`` in the topology); also what
    ``nodes.gateway.app.make_app`` takes when the gateway runs without a topology (tests, standalone)."""

    host: str = Field("127.0.0.1", description="Address to listen on; loopback by default (0.0.0.0 exposes it). "
                      "The agent node (agent.via: gateway) connects here too.")
    port: int = Field(9000, ge=0, le=65535, description="TCP port; 0 picks a free one (tests).")
    admin_token: str | None = Field(None, min_length=8, description="Token for opening sessions and for "
                                    "unrecorded calls: write ${AREAL_BUS_ADMIN_TOKEN}, never a literal. Unset, "
                                    "the topology validates but the gateway refuses to start (a secret: dumps "
                                    f"show {REDACTED!r}).", json_schema_extra={SECRET: True})
    policy_model: str = Field("policy", min_length=1, description="The model id agents send for the policy "
                              "being trained; any other id goes to the router (or is a 404).")
    router_config: str | None = Field(None, min_length=1, description="The model router's YAML "
                                      "(areal_bus/router.py), relative to the supervisord.conf's folder: requests "
                                      "for models other than policy_model go through it. None: they are a 404.")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="Largest request body; larger is a 413.")
    max_sessions: int = Field(1000, ge=1, le=1_000_000, description="Open sessions at most; past it "
                              "POST /rl/sessions is a 429 until some end or expire.")
    session_idle_timeout_s: float = Field(300.0, gt=0, le=7 * 86400, description="A session with no request "
                                          "for this long is ended (its trajectory emitted as it stands).")
    max_context_tokens: int | None = Field(None, ge=2, description="Prompt + output tokens per sequence; in a "
                                           "topology, left unset, rollout_engine.max_len (without one: asked of "
                                           "the backend).")
    default_max_tokens: int | None = Field(None, ge=1, description="Completion budget when a request names "
                                           "none. None: the rest of the context, as OpenAI's API does.")
    max_pending_requests: int = Field(2048, ge=1, le=1_000_000, description="Policy generations waiting on or "
                                      "running in the backend at most; past it a chat request is a 429 with "
                                      "Retry-After.")
    wal: bool = Field(True, description="Keep open sessions and ended sessions' trajectories in a local SQLite "
                      "WAL until the trainer acknowledges them: a 2xx survives a kill -9, and a restarted gateway "
                      "resumes its sessions. false: in memory only.")
    wal_fsync: bool = Field(False, description="Flush the disk at every WAL commit (SQLite synchronous=FULL): "
                            "survives power loss too, at a flush per reply. false survives any process crash.")
    header_timeout_s: float = Field(HTTP_HEADER_TIMEOUT_S, gt=0, le=3600, description="A request line and "
                                    "headers not complete this long after the connection opened (or after its "
                                    "previous reply, kept alive) close the connection.")
    body_timeout_s: float = Field(HTTP_BODY_TIMEOUT_S, gt=0, le=3600, description="A request body not "
                                  "complete this long after its headers is a 408, and the connection closes.")
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="How the policy's tool calls are written and parsed (nodes/gateway/parsers.py): "
        "hermes (Qwen2.5/Qwen3), llama3_json (Llama 3.x) or mistral. auto: read from the chat template (hermes "
        "when it names none).")
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        "auto", description="think: the reply's <think>...</think> text is reasoning (OpenAI reasoning_content, "
        "Anthropic thinking blocks), the rest content; none: all of it is content. auto: think when the chat "
        "template mentions <think>.")

    @field_validator("admin_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        # `${AREAL_BUS_ADMIN_TOKEN:-}` expands to "" where the variable is unset: the same as no token,
        # so a topology can be validated and rendered in a shell that does not hold the secret. A dump's
        # marker read back (the trainer's other ranks read one) is no token either: never a password.
        return None if v in ("", REDACTED) else v

    @field_validator("admin_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if "${" in v:
            raise ValueError("looks like an unexpanded ${VAR}: export the variable in the shell that renders "
                             "and starts the run")
        if v != v.strip():
            raise ValueError("has leading or trailing whitespace (a newline from a file?); strip it")
        return v

    @property
    def base_url(self) -> str:
        """Where a client on this host reaches the gateway (no /v1)."""
        return f"http://{self.host}:{self.port}"


class ProbeConfig(_Strict):
    """``nodes.probe.config``: the probe node's Prometheus endpoint (GET /metrics, the families of
    areal_bus/runtime/prometheus.py, from the heartbeats it hears)."""

    enabled: bool = Field(True, description="Serve the Prometheus exposition; false: the probe only logs.")
    metrics_host: str = Field("127.0.0.1", min_length=1, description="Address the endpoint listens on; loopback "
                              "by default (0.0.0.0 lets any host that reaches this one scrape the run's metrics).")
    metrics_port: int = Field(9400, ge=0, le=65535, description="TCP port; replica N listens on metrics_port + N "
                              "(0: a free one, written to log_dir/probe-<N>.metrics_url).")


DEFAULT_RUBRIC = """You are grading one episode of an AI agent working on a task.

Task:
{task}

Transcript of the agent's turns and the environment's replies:
{transcript}

Score 0-10: 10 means the task was fully solved, 0 means no progress. Reply with the score first
(for example "Score: 7"), then one sentence saying why."""


class RewardNodeConfig(_Strict):
    """``nodes.reward.config``: the judge or reward model the reward node scores with when
    ``agent.reward_source`` is 'judge' or 'reward_model' (the source itself is written there only)."""

    router_config: str = Field("configs/router.yaml", min_length=1, description="judge: the router YAML "
                               "(relative to the supervisord.conf's folder). Checked by `areal-bus validate`.")
    judge_model: str = Field("judge_model", min_length=1, description="judge: the route (role or model_id) asked.")
    rubric: str = Field(DEFAULT_RUBRIC, min_length=1, description="judge: the prompt; {task} and {transcript} "
                        "are replaced by the episode's task statement and text.")
    score_scale: float = Field(10.0, gt=0, description="judge: the top of the judge's scale; reward = score / scale, "
                               "clipped to [0, 1].")
    model_path: str | None = Field(None, min_length=1, description="reward_model: a Hugging Face "
                                   "sequence-classification checkpoint (relative to the supervisord.conf's folder).")
    device: str = Field("cpu", description="reward_model: torch device.")
    max_length: int = Field(2048, ge=8, le=1_000_000, description="reward_model: tokens scored (the start is "
                            "kept, the rest cut).")

    @model_validator(mode="before")
    @classmethod
    def _source_is_the_agents(cls, data):
        if isinstance(data, dict) and "reward_source" in data:
            raise ValueError(f"nodes.reward.config.reward_source: the reward source is written in one place, "
                             f"agent.reward_source; write agent.reward_source: {data['reward_source']} and keep "
                             f"the judge's or reward model's settings here")
        return data
