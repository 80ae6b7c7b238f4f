"""Numerics: what low precision does to a model's tensors, watched (one watcher, telemetry,
dtype truth), and the judgements read from it (forecast, fp8 risk, first events)."""
