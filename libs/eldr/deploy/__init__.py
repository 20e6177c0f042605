"""Deployment: the `eldr deploy` CLI (NATS auth configuration, overlays rendered by kubectl)."""
