"""The job book and the core: client operations, rank reports in, one transaction per change, results.

May import: the rooms api, batch, diagnosis, fleet, logs, model, recovery, scheduling, store of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
