"""rankctl models."""
