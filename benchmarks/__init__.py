"""kvsvc benchmarks: scripts that print measured figures beside their references.

Run them all with ``python -m benchmarks.run [--quick] [--out bench-results]``.
"""
