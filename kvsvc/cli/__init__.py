"""The ``kvsvc`` command (``kvsvc.cli.main``): serve, demo, init-auth, and the
grpc_health_probe stand-in. It may import both the client and the server."""
