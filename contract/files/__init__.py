"""The files a rank and its daemon share, and the safe ways to write them.

May import: no other room of ``contract``; no grpc, no protobuf (``tests/unit/repo/test_import_rules.py``).
"""
