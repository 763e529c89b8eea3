"""edl-agent: node agent and central restarter for accelerator clusters on Kubernetes."""

__version__ = "0.1.0"
