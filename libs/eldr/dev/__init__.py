"""Local development stack: embedded nats-server, process supervisor, demo driver."""
