"""kvsvc: a gRPC service that moves LLM KV-cache blocks between inference-engine
workers and a cache server, and never lets a failure look like silence."""

__version__ = "0.1.0"
