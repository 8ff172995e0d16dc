"""rankctl coordinator."""
