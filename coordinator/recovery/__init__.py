"""What follows a failed, drained or hung attempt: restart decisions, drains, the advance of a job.

May import: the rooms api, diagnosis, fleet, jobs, model, scheduling, store of ``coordinator``; no grpc, no protobuf (``tests/unit/repo/test_import_rules.py``).
"""
