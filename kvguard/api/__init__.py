"""kvguard's own HTTP surface and telemetry: routes, status document, metrics, logs."""
