"""One module per ``ctl`` command group, loaded lazily by ``cli.main``.

May import: the rooms view of ``cli``; protobuf stubs (``tests/unit/repo/test_import_rules.py``).
"""
