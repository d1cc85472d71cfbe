"""Communication between processes: the wire format, the point-to-point channel, the data-parallel replicas and the
liveness watchdog. No Lightning imports."""
