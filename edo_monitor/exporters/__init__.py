"""Where a live run's readings go out besides the history: Prometheus exposition (live and over a
history) and TensorBoard scalars and events. Takes readings and events; hands on metric families."""
