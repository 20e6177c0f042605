"""The only module that talks to NATS: connect, topology, publish, serve, consume, drain."""
