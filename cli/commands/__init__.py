"""One module per ``ctl`` command group, loaded lazily by ``cli.main``."""
