"""The gRPC surface: servicers, protobuf <-> domain conversion, authorization, who answers.

May import: the rooms batch, diagnosis, fleet, jobs, logs, model, scheduling, store of ``coordinator``; grpc and protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
