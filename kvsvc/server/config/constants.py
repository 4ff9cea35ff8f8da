"""The server's fixed limits: numbers chosen in code, not settings (no flag or
variable sets them), kept beside the settings so one package holds every knob."""

from __future__ import annotations

from kvsvc.limits import MiB

# --- sealed memfd passing (kvsvc.client.fdpass) ---
# A passed fd that a Map has used is held until this long after it was passed (a
# failed Map can be retried, ranks can share one fd); one that no Map has used is
# closed FD_TOKEN_UNUSED_TTL_S after it was passed, so an abandoned pass frees its
# place promptly.
FD_TOKEN_TTL_S = 60.0
FD_TOKEN_UNUSED_TTL_S = 10.0
# At most this many passed fds held at once (and at most a quarter of the soft
# RLIMIT_NOFILE), and at most FD_TOKENS_PER_PEER_MAX from one process, so one
# cannot take every place. Peers in another pid namespace show as pid 0: they
# share one per-peer quota.
FD_TOKENS_MAX = 1024
FD_TOKENS_PER_PEER_MAX = 256
# The fd socket serves up to FD_PEERS_MAX connections at once; one that has not
# sent its fd FD_PEER_TIMEOUT_S after it was accepted is closed, and never delays
# the others.
FD_PEERS_MAX = 64
FD_PEER_TIMEOUT_S = 2.0
# Lease connections (kvsvc.client.fdpass.FdLease) stay open while their engine lives: at
# most this many at once (one fd each; an engine process needs one).
FD_LEASES_MAX = 1024
# How often the server looks for mappings whose memfd owner is gone without
# being told (a one-shot pass's pid exited); a lease that ends wakes it at once.
MAPPING_REAP_INTERVAL_S = 1.0

# --- the remote tier (kvsvc.server.tiers.redis) ---
REMOTE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
# Failures in a row that open the breaker; then one probe call after this long.
REMOTE_BREAKER_FAILURES = 3
REMOTE_BREAKER_OPEN_S = 2.0
# How often the tier asks Redis which run it is (INFO server's run_id): a restarted
# Redis is empty, and the keys announced on the events stream are withdrawn.
REMOTE_RUN_CHECK_S = 0.5
# Threads that read from Redis (at most this many exchanges wait on it at once;
# beyond, a read is a miss at once) and that write to it.
REMOTE_FETCHERS = 4
REMOTE_WRITERS = 2
# A writer sends up to this many bytes of queued chunks in one pipeline (its
# staging buffer holds them: smaller batches let one writer copy while the other sends).
REMOTE_WRITE_BATCH_BYTES = 16 * MiB
# A Retrieve's GET replies are handed to the copy into the store in groups of
# about this many bytes while the next replies are still being read.
REMOTE_FETCH_GROUP_BYTES = 16 * MiB
# Bytes the sync clients (they carry values) read from the socket at once
# (redis-py's default: 64 KiB, one read and one parser feed per 64 KiB of a value).
REMOTE_SOCKET_READ_BYTES = 1 * MiB
# With --remote, glibc's malloc keeps up to this many freed bytes at the top of
# each heap and serves large blocks from its heaps, not fresh mmaps: the bytes
# objects hiredis makes for values (one per value, megabytes each) then reuse
# memory already faulted in (kvsvc.server.tiers.redis.reuse_freed_memory).
REMOTE_MALLOC_KEEP_BYTES = 256 * MiB
# --remote's host name is looked up again this often (a failed lookup: after
# REMOTE_BREAKER_OPEN_S); Redis is called only while the last answer was good.
REMOTE_DNS_REFRESH_S = 30.0
