"""KV store service: KV block bytes keyed by content hash."""
