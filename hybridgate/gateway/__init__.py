"""The grpc.aio service: validation at the edge, health, reflection, metrics."""
