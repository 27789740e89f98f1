"""The operator's view: /health, /metrics, /version, the live /dashboard and OpenTelemetry traces."""
