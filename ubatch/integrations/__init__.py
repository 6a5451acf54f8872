"""Adapters that make models ubatch did not write DBO-capable (each imports its framework lazily)."""
