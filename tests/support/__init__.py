"""Helpers shared by tests of several directories (on `sys.path` through pytest's
`pythonpath = ["tests"]`): import as `from support.messages import ...`."""
