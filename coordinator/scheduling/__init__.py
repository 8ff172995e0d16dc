"""Placing jobs: capacity, queue order, the plan each node receives, fan-outs and relays, stops.

May import: the rooms fleet, jobs, model, store of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
