"""The worker daemon process: assembly, settings, side tasks, its metrics and the node's usage."""
