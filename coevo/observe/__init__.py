"""Seeing a run: metrics from events, their sinks, the live dashboard and the report.

One aggregator (``aggregate.Aggregator``: events in, time series and page views out, no I/O) is fed
by an ``observer.Observer`` tailing the run's stream (inside ``coevo run``, as ``coevo agent metrics``,
behind ``coevo dashboard``) or by a finished run's history (``coevo report``). Its points go to
TensorBoard and W&B (``sinks``), Prometheus (``exposition``), the dashboard's pages (``dashboard``,
``static/``) and the report's PNG plots (``report``). ``progress`` is the progress bar of long
offline commands. Modules are imported where used: importing this package imports nothing heavy.
"""
