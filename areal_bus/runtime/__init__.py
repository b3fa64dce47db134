"""What every node process runs on: the node shell with its heartbeat (``node``), structured logs
(``logs``), metrics and their Prometheus view (``metrics``, ``prometheus``), the trajectory ledger
(``ledger``) and the trainer's durable spool (``spool``)."""
