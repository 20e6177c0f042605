"""Pure pieces of partition training: the window of recent signatures, the trainer's
configuration, drift detection and the shadow gate (`online`), and the refit plan (window,
fit, shadow, verdict) the trainer and the online benchmark both run."""
