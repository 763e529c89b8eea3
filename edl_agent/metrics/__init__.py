"""Prometheus metrics: collectors read the agent's state at scrape time and an HTTP server
exposes them with /healthz and /readyz; pod attribution comes from kubelet's pod-resources API."""
