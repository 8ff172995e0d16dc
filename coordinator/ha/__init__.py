"""Coordinators on etcd: the client, the replicated journal, leader election, blobs on etcd, the standby/leader switch.

May import: the rooms store of ``coordinator``; grpc (``tests/unit/repo/test_import_rules.py``).
"""
