"""The chassis every process runs on: config, gRPC servers and channels, security,
tracing, metrics, logging and shutdown, and where a service finds its model."""
