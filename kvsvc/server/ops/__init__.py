"""Operating the server: its life (``lifecycle``: start, signals, drain),
health (``health``), Prometheus metrics (``metrics``) and fault injection
(``failpoints``)."""
