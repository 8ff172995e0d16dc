"""The worker daemon process: assembly, settings, side tasks, its metrics and the node's usage.

May import: the rooms files, replication, runs, uplink of ``worker``; grpc and protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
