"""The connector's link to kvsvc, one per role and process: the ``Link`` every
engine plug-in shares (kvsvc.integrations.common: a client that a failure
replaces, and a "down until" time during which the connector skips kvsvc),
logging as the vLLM connector."""

from __future__ import annotations

from kvsvc.integrations.common import LINK_ERRORS, make_client
from kvsvc.integrations.common import Link as _Link
from kvsvc.integrations.vllm.common import log

__all__ = ["LINK_ERRORS", "Link", "make_client"]


class Link(_Link):
    log = log
