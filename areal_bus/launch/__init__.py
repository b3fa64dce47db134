"""The launcher, run by the user and by supervisord, never by a node: the ``areal-bus`` command
(``cli``), starting and ending a run (``run``, ``runend``, ``watchdog``), rendering a topology to a
supervisord.conf (``render``), plots, model import and the default's warm start."""
