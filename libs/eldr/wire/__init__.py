"""Typed MessagePack wire schemas (msgspec Structs) for every message on the bus."""
