"""Persistence: SQLAlchemy 2 models and repository functions for partition versions."""
