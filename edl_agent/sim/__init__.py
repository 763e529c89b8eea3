"""Simulated nodes: a host-root tree built from a profile, read by the same code as a real node."""
