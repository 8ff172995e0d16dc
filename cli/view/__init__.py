"""What ``ctl`` shows: rendering, the live view, log lines, stdout/stderr."""
