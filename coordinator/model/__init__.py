"""The domain model: records, the job state machine, typed failures, errors, bounds (no grpc, no store).

May import: no other room of ``coordinator``; no grpc, no protobuf (``tests/unit/repo/test_import_rules.py``).
"""
