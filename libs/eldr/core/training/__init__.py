"""Pure pieces of partition training: the window of recent signatures a refit reads."""
