"""The gateway's side of the engine: the EngineClient protocol, its gRPC and routed
implementations, disaggregation, migration, stream replay."""
