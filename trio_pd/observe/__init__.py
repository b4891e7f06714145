"""Observability: the Prometheus metrics and the logs (access log, JSON lines, log files)."""
