"""ELDR simdecode service."""
