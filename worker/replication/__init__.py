"""Checkpoint and snapshot copies between nodes.

May import: the rooms daemon, files, runs, uplink of ``worker``; grpc and protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
