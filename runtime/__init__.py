"""The rank runtime: what a forked rank process runs (rendezvous, groups, one job kind)."""
