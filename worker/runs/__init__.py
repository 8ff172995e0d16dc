"""The job attempts on this node: admission, rank files, what the ranks and their processes do, the launcher's client."""
