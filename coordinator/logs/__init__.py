"""Rank logs: fetched from their nodes, archived before an allocation ends.

May import: the rooms fleet, model of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
