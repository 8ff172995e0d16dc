"""The node agent: worker daemon (session with the coordinator), warm launcher, forker, log shipping.

It launches ``rankctl.runtime`` in forked rank processes; the training runtime itself is not here."""
