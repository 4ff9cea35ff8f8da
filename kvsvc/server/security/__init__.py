"""Who is calling and what they may touch: tenants, tokens and mTLS identities,
the interceptor (``auth``), and long-lived streams' credentials kept true across
reloads (``credentials``)."""
