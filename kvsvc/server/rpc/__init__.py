"""The RPC layer: the one wrapper every call goes through (``wrapper``), the
servicer that is the composition root and the RPC table (``servicer``), the
Session stream's server end (``session``) and running a first step without a
task (``eager``)."""
