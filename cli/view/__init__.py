"""What ``ctl`` shows: rendering, the live view, log lines, stdout/stderr.

May import: no other room of ``cli``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
