"""The worker nodes: sessions, heartbeats, registrations, acks."""
