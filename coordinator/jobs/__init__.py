"""The job book and the core: client operations, rank reports in, one transaction per change, results."""
