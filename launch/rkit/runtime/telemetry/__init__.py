"""Telemetry written and served inside a job: each rank's metrics lines (metrics), the node's sampler and GPU
probes (node, health, gpu), the Prometheus exporter (exporter) and what it may expose (exposure)."""
