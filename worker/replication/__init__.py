"""Checkpoint and snapshot copies between nodes."""
