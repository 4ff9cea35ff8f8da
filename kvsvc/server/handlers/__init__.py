"""What each RPC does: Store, Retrieve and Fence (``transfers``), Lookup
(``lookup``), Map and Unmap (``mappings``), DropNamespace (``namespaces``), and the
checks of a request's body they share (``requests``). Tiers below memory are
reached only through the chain (kvsvc.server.tiers)."""
