"""The run's configuration: the topology schema (``topology``: every knob, one pydantic tree), the
per-node settings (``node_configs``), which host runs which process (``placement``) and the files a run
reads, checked before anything starts (``files``)."""
