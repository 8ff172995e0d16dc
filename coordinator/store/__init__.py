"""The coordinator's durable state: the SQLite store, its schema, blobs, change capture and migration.

May import: the rooms api, ha, model of ``coordinator``; grpc (``tests/unit/repo/test_import_rules.py``).
"""
