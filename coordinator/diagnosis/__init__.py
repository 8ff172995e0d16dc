"""Where a job's ranks are and what is wrong with them: progress counters, pace, skew, hangs, pre-flight."""
