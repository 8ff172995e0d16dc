"""The warm launcher, its own process: forks ranks, contains their processes, bounds their memory.

May import: the rooms daemon, files, runs of ``worker``; no grpc, no protobuf (``tests/unit/repo/test_import_rules.py``).
"""
