"""Pure values and rules: token trees, sampling and acceptance, the KV store, the cost model, the allocator,
settings."""
