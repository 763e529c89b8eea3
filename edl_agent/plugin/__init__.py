"""Kubelet device plugin: per-resource gRPC servers and the pure decisions behind them."""
