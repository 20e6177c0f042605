"""Replay of recorded decisions: event log, event sources, the replay engine, explain, CLI."""
