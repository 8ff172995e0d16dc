"""The coordinator's durable state: the SQLite store, its schema, blobs, change capture and migration."""
