"""Rank logs: fetched from their nodes, archived before an allocation ends."""
