"""The coordinator's web dashboard (``ctl coordinator --http-listen``): jobs, a live job page, nodes, plan,
and ``/metrics``; server-rendered HTML on the coordinator's event loop. See docs/dashboard.md.

May import: the rooms api, diagnosis, fleet, jobs, logs, model, scheduling, store of ``coordinator``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
