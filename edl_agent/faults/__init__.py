"""Faults: what agents and watchers observe and the restarter acts on."""
