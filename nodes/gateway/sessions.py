"""Sessions: an agent's episode, recorded token for token, ended into trajectories. No sockets here.

A session is created by the orchestrator (``POST /rl/sessions`` with the admin token) and gets a key;
the agent uses the key as its API key. Every completion the policy produces for the session is
recorded with the exact ids sampled, their log-probabilities and policy versions (the engine's
``Completion``), between the environment tokens the gateway rendered around them (loss mask 0).

Branches. The record is kept as a set of linear *branches* (the tips of the conversation tree), each
a first prompt followed by completions and the rendered tokens between them:
- a turn whose messages extend a branch's history (same messages, same assistant replies as they
  were returned, same tools) extends that branch, and its prompt is the branch's ids + only the new
  messages' tokens (chat.ChatRenderer.continuation_ids): no re-tokenisation;
- a turn that matches no branch (the client rewrote or truncated its history, or changed tools) starts
  a new *segment*: a fresh prompt, recorded in the same session, flagged ``history_rewritten`` in the
  trajectory meta;
- ``n > 1`` forks: each choice becomes a branch, and the one the client continues with is extended;
  a request that continues from an earlier point of a branch (a retry of a turn already recorded)
  forks there.
Ending a session turns every branch into one Trajectory. The usual session (n = 1, history kept) has
one branch and ends as exactly one trajectory, with ``traj_id`` = the session id; a session with
several branches ends as ``<session id>-b<i>`` for each, all with ``episode_id`` = the session id.
Each is trained on as its own sample, so none conditions the policy on tokens it never saw.

Rewards (``reward``): a value for one completion, or for the session (the outcome: it lands on the
last completion of every branch). With a per-turn ``discount`` g, a branch's turn rewards r_t become
returns G_t = r_t + g * G_{t+1}; the trajectory's reward is G_0 and the per-turn returns ride in
``meta["turn_returns"]``. With no reward given at all the trajectory's reward is None, and the reward
node scores it.

Keys: ``<session id>.<secret>`` (a selector and a verifier). The session id is not secret (it is in
URLs, logs and response ids), so finding the session by it leaks nothing; only sha256(secret) is
stored, and it is compared with ``hmac.compare_digest`` on digests of equal length, so the time a
check takes says nothing about how much of a guessed secret was right. A leaked store holds no key.
With a ``tag_key`` (the Gateway derives one from its admin token) the secret ends in an HMAC tag of the
session id and the random part: a gateway that no longer holds a session (restarted, or the session
ended long ago) still knows a key it minted, and answers "this session ended" rather than "invalid key";
a typo or a key spliced from two sessions fails the tag and stays an invalid key.

Durability (``wal``, a ``wal.GatewayWAL``): with one, every change a client is answered for is written
there first: a session opened (its key digest, never the key), a turn recorded, a reward, a session
ended (its trajectories replace its record). ``restore`` replays the log into a fresh store, so a
restarted gateway holds the open sessions as they were and their keys keep working.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from areal_bus.episode import EpisodeRecord
from areal_bus.wire.messages import Completion, Trajectory

ENDED_REMEMBERED = 10_000
"""Ended sessions whose keys are still recognised, so a late request hears "this session ended"
instead of "invalid key". A few hundred KB; older ones fall back to "invalid key"."""


KEY_TAG_CHARS = 22
"""Characters of a key's HMAC tag (16 bytes of HMAC-SHA256, URL-safe base64 without padding)."""

_KEY_RANDOM_CHARS = 43  # secrets.token_urlsafe(32)


class SessionLimitError(RuntimeError):
    """Too many open sessions: the caller should end some, or wait for idle ones to expire."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One completion of a turn, as the gateway recorded it and returned it."""

    completion: Completion
    """The engine's completion, cut after the token that completed a string stop if one did."""
    message: dict
    """The assistant message the client got (role, content, tool_calls)."""
    closed: bool
    """The sampled ids end with the template's eos (the turn is closed in the record)."""
    history: tuple
    """Canonical messages (chat.canonical) the record stands for, this reply included."""
    temperature: float = 1.0


@dataclass(frozen=True, slots=True)
class Branch:
    """A point of the record: a first prompt, then ("env", ids) and ("comp", Completion, index,
    temperature) parts, as this point and the points before it (``parent``) hold them. Each point keeps
    only what its turn added (the environment tokens and the completion, and the new messages), so a
    session of T turns holds O(T) of them, not O(T^2). Immutable: extending a branch makes a new point,
    so a concurrent turn can fork from the old."""

    prompt_ids: np.ndarray
    own_parts: tuple
    own_history: tuple
    depth: int
    """len(history): the messages this point stands for (canonical, this turn's reply included)."""
    key: int
    """_prefix_hashes(history)[-1]: what SessionStore.match looks this point up by."""
    tools_key: str
    segment: int
    closed: bool
    parent: Branch | None = None
    """The point this one extended: a request may continue from any earlier point, not just a tip."""

    def _chain(self) -> list[Branch]:
        chain, b = [], self
        while b is not None:
            chain.append(b)
            b = b.parent
        return chain[::-1]

    @property
    def parts(self) -> tuple:
        return tuple(p for b in self._chain() for p in b.own_parts)

    @property
    def history(self) -> tuple:
        return tuple(m for b in self._chain() for m in b.own_history)

    def holds(self, history) -> bool:
        """history[:self.depth] is this point's history (compared point by point: no whole copy)."""
        b, end = self, self.depth
        while b is not None:
            start = end - len(b.own_history)
            if start < 0 or tuple(history[start:end]) != b.own_history:
                return False
            b, end = b.parent, start
        return end == 0

    def next_prompt(self) -> np.ndarray:
        ids = [p[1].output_ids if p[0] == "comp" else p[1] for p in self.parts]
        return np.concatenate([self.prompt_ids, *ids]).astype(np.int32, copy=False)

    @property
    def completion_indices(self) -> list[int]:
        return [p[2] for p in self.parts if p[0] == "comp"]


@dataclass
class Session:
    id: str
    key_hash: bytes
    created_at: float
    last_active: float
    ticket: int  # the update it is admitted for (Admission.admit): on each of its GenerateRequests and trajectories
    group_id: str = ""
    meta: dict = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)
    completions: int = 0
    segments: int = 0
    rewards: dict[int, float] = field(default_factory=dict)
    outcome: float | None = None
    discount: float = 1.0
    inflight: int = 0
    reserved: set[int] = field(default_factory=set)  # completion indices of streamed turns not yet recorded
    index: dict = field(default_factory=dict)  # (tools key, prefix hash of its history) -> branches, in record order
    closing: bool = False
    ended: bool = False


def _point_index(branch: Branch | None) -> int | None:
    """A branch point's name in the WAL: the completion index its turn added (one per point)."""
    return None if branch is None else branch.own_parts[-1][2]


def key_digest(secret: str) -> bytes:
    """sha256 of a key as it came off the wire. surrogateescape: a header with bytes that are not UTF-8
    (aiohttp decodes them as lone surrogates) hashes to a digest that matches nothing, not an error."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()



def key_tag(tag_key: bytes, sid: str, random_part: str) -> str:
    """The tag that ends a session key's secret: HMAC-SHA256 of the session id and the random part."""
    mac = hmac.new(tag_key, f"{sid}.{random_part}".encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac[:16]).decode().rstrip("=")


def _prefix_hashes(history, h: int = 0) -> list[int]:
    """hashes[n - 1] stands for history[:n] (a hash of the hash before and the n-th message); ``h``:
    the hash of the messages before ``history`` (0: none)."""
    out = []
    for message in history:
        h = hash((h, message))
        out.append(h)
    return out


class SessionStore:
    def __init__(self, max_sessions: int = 1000, idle_timeout_s: float = 300.0, clock=time.monotonic, wal=None,
                 tag_key: bytes | None = None):
        self.max_sessions = max_sessions
        self.tag_key = tag_key  # None: keys carry no tag, and a forgotten session's key reads as invalid
        self.wal = wal  # GatewayWAL or None (in memory only: lost with the process)
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, tuple[bytes, str]] = OrderedDict()  # id -> (key hash, why)
        self._tickets = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def create(self, meta: dict | None = None, group_id: str = "", ticket: int | None = None) -> tuple[Session, str]:
        """A new session and its key (returned once; only its hash is kept)."""
        if len(self.sessions) >= self.max_sessions:
            raise SessionLimitError(f"{len(self.sessions)} sessions are open (max_sessions={self.max_sessions}); "
                                    f"end finished sessions, or wait for idle ones to expire "
                                    f"(after {self.idle_timeout_s:g} s)")
        sid = f"sess-{uuid.uuid4().hex[:20]}"
        secret = secrets.token_urlsafe(32)
        if self.tag_key is not None:
            secret += key_tag(self.tag_key, sid, secret)
        now = self.clock()
        if ticket is None:
            ticket, self._tickets = self._tickets, self._tickets + 1
        session = Session(sid, key_digest(secret), now, now, ticket, group_id, dict(meta or {}))
        if self.wal is not None:
            self.wal.opened(session)
        self.sessions[sid] = session
        return session, f"{sid}.{secret}"

    def authenticate(self, key: str) -> tuple[Session | None, str]:
        """(session, "") for a live session's key; (None, why) otherwise: "invalid", the reason a
        recently ended session ended ("ended", "idle", ...), or "gone" for a key this store's tag key
        minted whose session it does not hold (ended before a restart, or forgotten)."""
        sid, dot, secret = key.rpartition(".")
        if not dot:
            return None, "invalid"
        digest = key_digest(secret)
        session = self.sessions.get(sid)
        if session is not None and hmac.compare_digest(digest, session.key_hash):
            return (session, "") if not session.closing else (None, "ended")
        gone = self.ended.get(sid)
        if gone is not None and hmac.compare_digest(digest, gone[0]):
            return None, gone[1]
        if session is None and gone is None and self._minted(sid, secret):
            return None, "gone"
        return None, "invalid"

    def _minted(self, sid: str, secret: str) -> bool:
        if self.tag_key is None or len(secret) != _KEY_RANDOM_CHARS + KEY_TAG_CHARS:
            return False
        tag = key_tag(self.tag_key, sid, secret[:_KEY_RANDOM_CHARS])
        return hmac.compare_digest(tag.encode(), secret[_KEY_RANDOM_CHARS:].encode("utf-8", "surrogateescape"))

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def touch(self, session: Session) -> None:
        session.last_active = self.clock()

    def begin(self, session: Session) -> None:
        """A request of this session is in flight: it is not idle until ``finish``."""
        session.inflight += 1
        self.touch(session)

    def finish(self, session: Session) -> None:
        session.inflight -= 1
        self.touch(session)

    # -- turns ----------------------------------------------------------------------------------

    def match(self, session: Session, history: list[tuple], tools_key: str) -> Branch | None:
        """The branch this request continues: the longest whose history (ending with an assistant
        reply as it was returned) is a strict prefix of the request's messages, under the same tools.
        Earlier points of a branch count too: a request re-sent after its turn was recorded (an SDK
        retry after a timeout, a "regenerate") forks there instead of starting a new segment."""
        # Every point of every branch is indexed by a hash of its history, chained message by message,
        # so a request looks up each of its own prefixes once: linear in its length, not in the
        # session's (a walk over every branch point cost a millisecond a request at 400 turns).
        hashes = _prefix_hashes(history)
        for n in range(len(history) - 1, 0, -1):
            for b in session.index.get((tools_key, hashes[n - 1]), ()):
                if b.depth == n and b.holds(history):  # a hash match is checked against the messages
                    return b
        return None

    def reserve(self, session: Session, n: int) -> int:
        """Completion indices for a turn whose response id must be known before it is recorded (a
        live stream names it in its first event): the first of ``n``, passed on to ``record``. Those a
        failed turn never records stay unknown to ``reward``."""
        first = session.completions
        session.completions += n
        session.reserved.update(range(first, first + n))
        return first

    def record(self, session: Session, base: Branch | None, prompt_ids, env_ids, tools_key: str,
               choices: list[Choice], first: int | None = None) -> list[int]:
        """Fold one turn's choices into the session; their completion indices (from ``first``, if
        reserved). ``base`` is the branch the turn continued (``env_ids`` the tokens rendered after
        it), or None for a new segment whose first prompt is ``prompt_ids``. Called when the backend
        returns, whether or not the client is still connected."""
        if session.ended:
            raise RuntimeError(f"session {session.id} ended before its turn was recorded")
        reserved, first = first is not None, session.completions if first is None else first
        if self.wal is not None:  # on disk before the reply: a 2xx turn survives the process
            depth = base.depth if base is not None else 0
            self.wal.turn(session.id, _point_index(base), prompt_ids, env_ids, tools_key, first,
                          [(ch, ch.history[depth:]) for ch in choices])
        if reserved:
            session.reserved.difference_update(range(first, first + len(choices)))
        else:
            session.completions += len(choices)
        if base is None:
            session.segments += 1
            segment, prefix, depth, key = session.segments, (), 0, 0
            prompt = np.asarray(prompt_ids, dtype=np.int32)
        else:
            segment, prompt, depth, key = base.segment, base.prompt_ids, base.depth, base.key
            prefix = (("env", np.asarray(env_ids, dtype=np.int32)),)
        indices, made = [], []
        for k, ch in enumerate(choices):
            idx = first + k
            indices.append(idx)
            new = tuple(ch.history[depth:])  # the messages after base's: the request's own and the reply
            made.append(Branch(prompt, (*prefix, ("comp", ch.completion, idx, ch.temperature)), new,
                               depth + len(new), _prefix_hashes(new, key)[-1], tools_key, segment, ch.closed, base))
        for branch in made:
            session.index.setdefault((tools_key, branch.key), []).append(branch)
        if base is not None and any(b is base for b in session.branches):
            at = next(i for i, b in enumerate(session.branches) if b is base)
            session.branches[at:at + 1] = made[:1]  # the continued tip is now a prefix of its extension
            session.branches.extend(made[1:])
        else:  # a new segment, or a fork from an earlier point (or from a tip a concurrent turn extended)
            session.branches.extend(made)
        self.touch(session)
        return indices

    # -- rewards --------------------------------------------------------------------------------

    def reward(self, session: Session, value: float, completion_index: int | None = None,
               discount: float | None = None) -> None:
        """Reward one completion (by its index in the session) or the whole session (the outcome)."""
        if not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {value!r}")
        if discount is not None and not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount!r}")
        if completion_index is not None and not (0 <= completion_index < session.completions
                                                 and completion_index not in session.reserved):
            raise KeyError(f"session {session.id} has no completion {completion_index} "
                           f"(it has {session.completions}: 0..{session.completions - 1})")
        if self.wal is not None:
            self.wal.reward(session.id, float(value), completion_index, discount)
        if discount is not None:
            session.discount = discount
        if completion_index is None:
            session.outcome = float(value)
        else:
            session.rewards[completion_index] = float(value)
        self.touch(session)

    def _returns(self, session: Session, idx: list[int]) -> list[float] | None:
        """The discounted return of each of a branch's completions (``idx``: their indices), or None
        when nothing was rewarded."""
        if session.outcome is None and not any(i in session.rewards for i in idx):
            return None
        r = [session.rewards.get(i, 0.0) for i in idx]
        if session.outcome is not None:
            r[-1] += session.outcome
        g, out = 0.0, []
        for x in reversed(r):
            g = x + session.discount * g
            out.append(g)
        return out[::-1]

    # -- ending ---------------------------------------------------------------------------------

    def end(self, session: Session, reason: str = "ended", reward: float | None = None) -> list[Trajectory]:
        """Close the session and return its trajectories (one per branch; none if it never generated)."""
        if session.ended:
            return []
        if reward is not None:
            self.reward(session, reward)
        trajs = [self._trajectory(session, b, i, reason) for i, b in enumerate(session.branches)]
        if self.wal is not None:  # the trajectories are on disk before the session is gone (and /end answers)
            self.wal.ended(session.id, trajs)
        session.ended = session.closing = True
        self.sessions.pop(session.id, None)
        self.ended[session.id] = (session.key_hash, reason)
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)
        return trajs

    # -- restart --------------------------------------------------------------------------------

    def restore(self) -> tuple[int, list[tuple[str, str]]]:
        """Replay the WAL's open sessions into this (empty) store: (sessions resumed, [(session id, why)]
        for any that would not replay; those stay in the WAL, untouched, for a person to look at)."""
        wal, self.wal = self.wal, None  # replaying writes nothing back
        resumed, failed = 0, []
        try:
            for sid, key_hash, ticket, group_id, meta, journal in wal.open_sessions():
                now = self.clock()
                session = Session(sid, key_hash, now, now, ticket, group_id, meta)
                try:
                    for entry in journal:
                        self._replay(session, entry)
                except Exception as exc:  # deliberately tolerated: one bad record must not keep the gateway down
                    failed.append((sid, f"{type(exc).__name__}: {exc}"))
                    continue
                self.sessions[sid] = session
                self._tickets = max(self._tickets, ticket + 1)
                resumed += 1
        finally:
            self.wal = wal
        return resumed, failed

    def _replay(self, session: Session, entry: dict) -> None:
        if entry["t"] == "reward":
            self.reward(session, entry["value"], entry["index"], entry["discount"])
            return
        base = None
        if entry["base"] is not None:
            base = next(b for bs in session.index.values() for b in bs if _point_index(b) == entry["base"])
        before = base.history if base is not None else ()
        choices = [Choice(comp, {}, closed, (*before, *new), temp) for comp, closed, new, temp in entry["choices"]]
        first = entry["first"]
        session.completions = max(session.completions, first + len(choices))
        prompt = np.frombuffer(entry["prompt"], dtype=np.int32) if entry["prompt"] is not None else None
        env = np.frombuffer(entry["env"], dtype=np.int32) if entry["env"] is not None else None
        self.record(session, base, prompt, env, entry["tools"], choices, first)

    def expire_idle(self, now: float | None = None) -> list[Trajectory]:
        """End every session idle for longer than the timeout (none with a request in flight)."""
        now = self.clock() if now is None else now
        idle = [s for s in self.sessions.values()
                if s.inflight == 0 and not s.closing and now - s.last_active > self.idle_timeout_s]
        return [t for s in idle for t in self.end(s, "idle")]

    def _trajectory(self, session: Session, branch: Branch, i: int, reason: str) -> Trajectory:
        many = len(session.branches) > 1
        parts = branch.parts  # gathered from the branch's points once
        completions = [p[2] for p in parts if p[0] == "comp"]
        returns = self._returns(session, completions)
        meta = {**session.meta, "source": "gateway", "session": session.id, "end_reason": reason,
                "segment": branch.segment, "segments": session.segments,
                "history_rewritten": session.segments > 1, "branch": i, "branches": len(session.branches),
                "completions": completions,
                "temperatures": [p[3] for p in parts if p[0] == "comp"]}
        if returns is not None:
            meta["turn_returns"] = returns
            meta["discount"] = session.discount
        rec = EpisodeRecord(f"{session.id}-b{i}" if many else session.id, branch.prompt_ids,
                            group_id=session.group_id, ticket=session.ticket, meta=meta)
        for part in parts:
            if part[0] == "comp":
                rec.add_completion(part[1])
            else:
                rec.add_env(part[1])
        traj = rec.to_trajectory(returns[0] if returns is not None else None)
        traj.episode_id = session.id
        return traj
