"""Routing requests across engine replicas by where their prefixes are cached.

- ``prefix_index``: block hash -> replicas holding it, fed by KV events.
- ``replica_feed``: applies one replica's KVEvents stream to the index, in order.
- ``policies``: kv (prefix overlap weighed against load), load, round-robin.
- ``router``: the replicas, their loads, and ``Router.pick`` for a prompt.
- ``kv_event_subscriber``: the client loop that follows a replica's stream.
"""
