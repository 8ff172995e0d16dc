"""The worker nodes: sessions, heartbeats, registrations, acks.

May import: the rooms api, app, jobs, logs, model, recovery, scheduling, store of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
