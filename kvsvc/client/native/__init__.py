"""The presence index's key table: the compiled one (``presence.c``, built by the
package build; ``make native`` in place) where it was built, else :class:`PyTable`
with the same answers."""

from __future__ import annotations

from kvsvc.client.native.table import NATIVE, KeyTable, PyTable, new_table

__all__ = ["NATIVE", "KeyTable", "PyTable", "new_table"]
