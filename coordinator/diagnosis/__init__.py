"""Where a job's ranks are and what is wrong with them: progress counters, pace, skew, hangs, pre-flight.

May import: the rooms model of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
