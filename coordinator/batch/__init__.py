"""Jobs on batch-scheduler allocations (Slurm) and worker pools.

May import: the rooms api, fleet, jobs, model, recovery, store of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
