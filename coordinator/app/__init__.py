"""The coordinator process: its gRPC server, threads and tuning (what runs where)."""
