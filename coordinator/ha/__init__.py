"""Coordinators on etcd: the client, the replicated journal, leader election, blobs on etcd, the standby/leader switch."""
