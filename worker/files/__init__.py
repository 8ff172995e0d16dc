"""Where a job may touch the node's files: sandbox, shipped workdirs, mounts, /dev/shm, snapshot memory.

May import: the rooms replication of ``worker``; no grpc, no protobuf (``tests/unit/repo/test_import_rules.py``).
"""
