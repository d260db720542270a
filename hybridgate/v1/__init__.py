"""Generated gRPC code for proto/hybridgate/v1."""
