"""KV store service: KV block bytes keyed by (layout namespace, block hash), in tiers."""
