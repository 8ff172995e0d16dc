"""The gRPC surface: servicers, protobuf <-> domain conversion, authorization, who answers."""
