"""Who is calling: certificates that carry a name and a role, and the mTLS credentials built from them.

``identity`` is pure (the names and the role order); ``certs`` makes a CA and issues certificates
(cryptography); ``tls`` loads an identity directory and turns it into gRPC credentials.
"""
