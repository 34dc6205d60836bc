"""The chassis every process runs on: config, gRPC servers and channels, security,
tracing, metrics, logging and shutdown."""
