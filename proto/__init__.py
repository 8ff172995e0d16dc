"""rankctl proto."""
