"""Engine connectors. Each module imports its engine: import only the one your
engine loads (e.g. vLLM's ``kv_connector_module_path: kvsvc.integrations.vllm``);
the kvsvc package itself never imports them."""
