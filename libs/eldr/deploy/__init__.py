"""Deployment: rendering the manifests (kustomize subset) and the `eldr deploy` CLI."""
