"""rankctl worker."""
