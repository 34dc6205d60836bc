"""The public gRPC API (kvmesh.v1.Generation), served next to the HTTP API."""
