"""Operating the server: its life (``lifecycle``: start, signals, drain),
health (``health``) and the watchdog that fails it (``watchdog``), Prometheus
metrics (``metrics``) and fault injection (``failpoints``)."""
