"""Adapters for kubelet's own APIs that several parts share (pod-resources)."""
