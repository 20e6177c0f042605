"""ELDR trainer service."""
