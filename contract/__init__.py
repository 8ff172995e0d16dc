"""Facts both sides of the wire share (coordinator, worker daemon, rank runtime, ctl): no torch, no grpc."""
