"""ELDR router service."""
