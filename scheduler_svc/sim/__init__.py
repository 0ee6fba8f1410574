"""Capacity-planning simulator: the real scheduler core against a simulated worker."""
