"""ELDR signature service."""
