"""The warm launcher, its own process: forks ranks, contains their processes, bounds their memory."""
