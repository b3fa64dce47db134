"""The run's configuration: the topology schema (``topology``, the entry point: every knob, one pydantic
tree, written in ``base``, ``sections``, ``engines``, ``root`` and ``loading``), the per-node settings
(``node_configs``), every knob listed (``knobs``: `areal-bus knobs`, docs/knobs.md), which host runs
which process (``placement``) and the files a run reads, checked before anything starts (``files``)."""
