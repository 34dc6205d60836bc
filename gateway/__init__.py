"""The gateway service: OpenAI-compatible HTTP and public gRPC in front of the engine."""
