"""supervisord event listener that ends the run when training ends.

supervisord restarts programs that exit unexpectedly, but a trainer that reached max_steps exits 0,
an expected exit. This listener watches PROCESS_STATE_EXITED events; when the trainer exits expectedly
it asks supervisord (over its own XML-RPC socket) to shut everything down, so ``supervisord -c
supervisord.conf`` returns by itself at the end of a run. Rendered into every supervisord.conf as
``[eventlistener:run_end]``.
"""

from __future__ import annotations

import os
import sys

from supervisor import childutils


def should_stop(headers: dict, payload: str, program: str) -> bool:
    if headers.get("eventname") != "PROCESS_STATE_EXITED":
        return False
    fields, _ = childutils.eventdata(payload + "\n")
    return fields.get("groupname") == program and fields.get("expected") == "1"


def listen(program: str = "trainer") -> int:
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        stop = should_stop(headers, payload, program)
        childutils.listener.ok(sys.stdout)
        if stop:
            print(f"run_end: {program} finished; shutting supervisord down", file=sys.stderr, flush=True)
            childutils.getRPCInterface(os.environ).supervisor.shutdown()
