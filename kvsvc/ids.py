"""Request ids: 32 lowercase hex characters, each 128 fresh random bits.

A transfer's request id is its transfer id, which a Fence names: an id that could
be guessed from another would let one client wait on or bar another's copies
(tenants are kept apart on the server as well, see kvsvc.server.security.auth). ``os.urandom``
costs one ``getrandom`` call (about 1.5 µs); a counter behind a random prefix was
cheaper but predictable. A forked child draws its own bytes, so it never repeats
its parent's ids.
"""

from __future__ import annotations

import os


def new_request_id() -> str:
    """A fresh, unguessable request id (the same shape as ``uuid.uuid4().hex``)."""
    return os.urandom(16).hex()
