"""Placing jobs: capacity, queue order, the plan each node receives, fan-outs and relays, stops."""
