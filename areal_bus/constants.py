"""Constants that govern liveness and flow, in one place, each with why it has that value.

Nodes import these names; nothing else in the code base hard-codes a heartbeat, a timeout or a
high-water mark.
"""

# Wire -----------------------------------------------------------------------------------------
WIRE_VERSION = 3
"""Bumped on any incompatible change to the envelope or a message's fields. A frame carrying another
version is dropped and counted (never guessed at), so mixed deployments fail loudly in metrics."""

MAX_FRAMES = 32
"""More frames than any message type defines means a garbled or hostile sender; drop before decoding."""

MAX_HEADER_BYTES = 1 << 20
"""A msgpack header over 1 MiB is not one of ours (headers are small; bulk data rides in extra frames)."""

MAX_FRAME_BYTES = 256 << 20
"""The largest frame a socket takes (ZMQ_MAXMSGSIZE, set on every socket ``channels.open_socket`` makes): a
peer that sends a bigger one is disconnected before the frame is buffered, so a garbled or hostile length
prefix cannot make a node allocate gigabytes. Our largest frames are a weight chunk to another host
(``weights_transfer.DEFAULT_CHUNK_BYTES``, 64 MiB, which must stay below this) and a trajectory's per-token
array (at most ``rollout_engine.max_len`` <= 1,000,000 tokens of 8 bytes, 8 MB): 4x headroom."""

DROPS_PER_RECV = 256
"""Malformed messages one ``Receiver.recv`` call drops (counting each) on its way to a good one. Callers
read "nothing" as "nothing waiting" and go back to their poll, so without this a flood of junk would
let through one good message per main-loop turn; bounded so that a flood still yields to the loop."""

# Liveness -------------------------------------------------------------------------------------
HEARTBEAT_INTERVAL_S = 0.5
"""Every node publishes a heartbeat (with its metrics) this often. Half a second keeps the probe's
rates smooth and lets a dead peer be noticed within ~2 s, at a cost of a few hundred bytes per node."""

HEARTBEAT_LIVENESS = 4
"""A peer is declared dead after this many missed heartbeats (2 s at 0.5 s). Three is the ZeroMQ
guide's Paranoid Pirate default; one more absorbs a GC pause or a busy 2-core CI box."""

# Flow -----------------------------------------------------------------------------------------
WORK_HWM = 1
"""High-water mark on the generation-work PUSH/PULL pipes. One message per pipe means the PUSH side's
round robin skips busy workers (their pipe is full) so work goes to whoever has a free slot, and a
request is never stranded deep in a dead worker's pipe."""

PUB_HWM = 10_000
"""PUB/SUB high-water mark. Events and metrics are small; 10k absorbs a subscriber's hiccup without
letting a stuck subscriber grow the publisher's memory without bound."""

RESEND_AFTER_S = 30.0
"""An unacknowledged trajectory is sent again after this long even if no consumer restart was seen.
Long enough that a trajectory waiting in a full (but healthy) trainer queue is not duplicated in the
normal case; duplicates are harmless anyway (the trainer drops them by id)."""

REISSUE_UNCLAIMED_S = 20.0
"""A generation request that no live rollout worker has claimed for this long is issued again."""

ROLLOUT_DRAIN_S = 5.0
"""How long a rollout worker told to stop (scaled away) may go on finishing the requests it runs
before it hands the rest back. Half of supervisord's stopwaitsecs (10 s), so it exits by itself, with
LINGER_MS to spare, before SIGKILL; long enough for the tiny model's and the simulated engine's
generations, while a long GPU generation cut off here is reissued and costs only its recomputation."""

LINGER_MS = 500
"""How long close() may wait to flush queued messages. Nodes shut down on SIGTERM; half a second is
enough to hand over acks and final metrics without holding up supervisord's stop."""

SEEN_IDS_MAX = 1_000_000
"""The trainer remembers this many consumed trajectory ids for duplicate suppression (~100 MB at most);
older ids fall out first, by which time their producers have long received the ack."""

GROUP_WAIT_S = 60.0
"""How long an async trainer holds the members of a GRPO group for the rest (``whole_groups``) when no
whole batch is ready: a member can be lost upstream (its episode failed, a reward dead-lettered) and,
with a small staleness bound, the queue may never fill past a global batch to release the others.
Long enough for a 3,000-token member on a busy GPU (~25 s measured), short enough that a lost member
costs one short stall, not a stuck run."""

STREAM_EVERY_S = 0.05
"""A streamed request's new tokens go to the gateway at most this often (its first token at once):
20 updates a second read as live text, and at a GPU's decode rate of hundreds of steps a second a
message per token per request would cost the rollout loop more than the decoding it reports on."""

POLL_MS = 50
"""Main-loop poll timeout. Short enough that SIGTERM and version announcements are handled promptly,
long enough that idle nodes cost nothing measurable."""

# HTTP (the gateway) ------------------------------------------------------------------------------
HTTP_HEADER_TIMEOUT_S = 10.0
"""A connection's request line and headers must be complete this long after its first byte (or after it
opened). aiohttp itself waits for ever once a byte has come, so a client that sends half a header holds a
connection and its buffers for good (220 held for 20 s and more). Ten seconds is far above any real
client's header time (one write of a few hundred bytes), and short enough that a slowloris must keep
opening connections faster than they are closed to hold many."""

HTTP_BODY_TIMEOUT_S = 60.0
"""A request body must be complete this long after its headers (a 408, then the connection closes). The
largest body allowed (max_body_bytes, 1 MiB by default) takes well under a second on any link an agent
uses; a minute leaves room for a very slow one and a long conversation's history."""

# Version trust ----------------------------------------------------------------------------------
VERSION_AHEAD_MAX = 1
"""How far a VersionAnnounce may be ahead of the version the trainer's own RunState reports. The
trainer exports version v+1 right after the update that made it, and the RunState saying v+1 may still
be on its way (another publisher, another path through the hub): one ahead is the normal race, more
is a forged or garbled announcement."""

LINEAGE_WAIT_S = 5.0
"""How long an announcement of a lineage no RunState has named yet is held before it is refused. A
restarted trainer exports its start weights before its first RunState goes out (half a second at
most, the RunState repeat); ten times that absorbs a loaded 2-core box without letting a forged
lineage sit unnoticed."""

SOURCE_GONE_S = 120.0
"""An episode source (agent, gateway) dead this long is gone for the others sharing the admission batch
(admission.Sources): removed while dead, or dead for good (FATAL), it would otherwise keep a share no
one uses for the rest of the run. supervisord restarts a crashed one within seconds (its backoff over
startretries), and one that comes back later takes its share again at its first heartbeat."""

WATCHDOG_SILENT_S = 5.0
"""A node whose heartbeat has been missing this long while its process lives is logged as stalled by
the watchdog (areal_bus/launch/watchdog.py). Peers call a node dead after 2 s (HEARTBEAT_LIVENESS); the
watchdog waits longer, so a GC pause or a loaded box is not reported, and only for the process that
is still there: the one a restart by supervisord would not cover."""

WATCHDOG_FIRST_BEAT_S = 300.0
"""How long a node may run before its first heartbeat before the watchdog reports it (never kills it):
nodes build their engine first, and vLLM starts in 26-42 s, a large checkpoint loads in minutes."""

WATCHDOG_RESTART_MAX_S = 3600.0
"""The longest durability.watchdog_restart_s may be: a node silent an hour is not coming back."""
