"""The coordinator process: its gRPC server, threads and tuning (what runs where).

May import: the rooms api, batch, ha, jobs, scheduling, store, web of ``coordinator``; grpc and protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
