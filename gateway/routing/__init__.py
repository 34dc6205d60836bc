"""Routing requests across engine replicas by where their prefixes are cached.

- ``prefix_index``: block hash -> replicas holding it, fed by KV events.
- ``replica_feed``: applies one replica's KVEvents stream to the index, in order.
- ``replica_state``: what the router knows of a replica (feed, load, readiness).
- ``policies``: kv (prefix overlap weighed against load), load, round-robin.
- ``config``: the policy and its tuning.
- ``router``: the replicas and ``Router.pick`` for a prompt.
- ``kv_event_subscriber``: the client loop that follows a replica's stream.
"""
