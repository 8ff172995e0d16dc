"""The domain model: records, the job state machine, typed failures, errors, bounds (no grpc, no store)."""
