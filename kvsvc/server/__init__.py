"""The cache server: the RPC wrapper and servicer, the Session stream's server
end, lifecycle and health, configuration, auth, metrics and failpoints. The data
plane (store, transfers, copies, regions, fd broker) is ``kvsvc.server.data``;
tiers below memory are ``kvsvc.server.tiers``. Never imports ``kvsvc.client``."""
