"""Integration tests use the shared fixtures of tests/conftest.py (real nats-server, a
throwaway PostgreSQL database)."""
