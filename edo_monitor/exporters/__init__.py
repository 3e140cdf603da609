"""Where a live run's readings go out besides the history: Prometheus exposition (live and
over a history). Takes readings and the store; hands on metric families."""
