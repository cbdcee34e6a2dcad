"""Operations: Prometheus metrics, the monitoring HTTP server, and replay."""
