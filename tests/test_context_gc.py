"""A bus context dropped without destroy() never blocks the garbage collector: it once hung an
unrelated test for good (pyzmq's Context.__del__ -> term() waiting on a socket closed with ZeroMQ's
default linger, for ever, holding a message for a peer that was gone)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import gc, zmq
from areal_bus.wire.security import BusContext
ctx = BusContext()
s = ctx.socket(zmq.PUSH)          # not through channels.open_socket: no linger of its own
s.connect("tcp://127.0.0.1:9")    # nobody there: the message stays queued
s.send(b"x")
if {close}:
    s.close()
del s, ctx
gc.collect()
print("collected")
"""


@pytest.mark.parametrize("close", [True, False], ids=["socket closed", "socket left open"])
def test_a_dropped_context_with_a_queued_message_is_collected(close):
    # A liveness check, not a timing: before the fix the child never finished.
    out = subprocess.run([sys.executable, "-c", CHILD.format(close=close)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "collected"


CYCLE = """
import gc, zmq
from areal_bus.wire.security import BusContext

class Node:  # holds its context and socket, and itself: garbage only the cycle collector frees
    def __init__(self):
        self.ctx = BusContext()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect("tcp://127.0.0.1:9")
        self.sock.send(b"x")
        self.me = self

gc.disable()
Node()
gc.collect()   # the context's weak references to its socket are cleared before either is finalized
print("collected")
"""


def test_a_context_collected_in_one_cycle_with_its_socket_does_not_block():
    out = subprocess.run([sys.executable, "-c", CYCLE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "collected"
