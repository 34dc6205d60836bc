"""The scheduler service: request table, token budget, KV block pool, prefix cache.

The core modules (``config``, ``request``, ``block_pool``, ``kv_cache_manager``,
``policy``, ``scheduler``) are pure Python with no I/O, so they are tested
without a model or a network; the service loop wraps them.
"""
