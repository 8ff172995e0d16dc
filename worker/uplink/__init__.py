"""What the daemon says to the coordinator: the session stream, the report buffer and fold, relays, logs.

May import: the rooms daemon, files, replication of ``worker``; grpc and protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
