"""What the daemon says to the coordinator: the session stream, the report buffer and fold, relays, logs."""
