"""Parallel building blocks: pure rank layout and placement, process groups, TP/SP/CP/EP/PP/DP."""
