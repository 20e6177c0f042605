"""ELDR simprefill service."""
