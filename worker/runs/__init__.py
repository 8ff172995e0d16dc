"""The job attempts on this node: admission, rank files, what the ranks and their processes do, the launcher's client.

May import: the rooms daemon, files, replication, uplink of ``worker``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
