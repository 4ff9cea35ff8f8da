"""kvsvc benchmarks: scripts that print measured figures beside their references.

Run them all with ``python -m benchmarks.run [--quick] [--out bench-results]``.
"""

import os

# Torch's OpenMP threads (libgomp) spin after each copy, by default long enough to
# take a core from whatever runs next on 2 cores: kvsvc, preadv, the next call
# (measured in benchmarks.data_plane: preadv halved, kvsvc -10-15% at 32 MiB x 1).
# A short spin keeps torch's own back-to-back copies fast (faster than the default
# here) and frees the core at once; OMP_WAIT_POLICY=PASSIVE instead made torch wake
# per copy and its figures swing 3-7 GB/s. Read when torch loads, so here: every
# ``python -m benchmarks.X`` imports this package first.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
