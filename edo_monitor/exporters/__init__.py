"""Where a run's readings go out besides the history: Prometheus exposition (live and over a
history), TensorBoard scalars and events, a run's samples as files. Takes readings, events and
stored samples; hands on metric families and rows."""
