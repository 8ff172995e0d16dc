"""rankctl cli."""
