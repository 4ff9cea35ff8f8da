"""The cache server, a folder per role: ``rpc`` (the wrapper every call goes
through, the servicer that builds the parts, the Session stream), ``handlers``
(what each RPC does), ``security`` (tenants and credentials), ``ops`` (life,
health, metrics, failpoints), ``config`` (every setting, declared once), ``data``
(the store, the copy engine, regions, the fd broker), ``tiers`` (the tiers below
memory behind one interface) and ``events`` (the WatchEvents stream). Never
imports ``kvsvc.client``."""
