"""Tiers below the memory store, each best-effort: a tier that fails or fills is a
miss or a skipped write, never a failed call."""
