"""The hook's counters on SGLang's ``/metrics``: samples committed, failed (by cause) and dropped.

SGLang started with ``--enable-metrics`` runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
is set before its scheduler processes start), so counters made in a scheduler process are served by its HTTP
server. Without it, or without prometheus_client, nothing is published and the log alone says what happened.
"""

from __future__ import annotations

import functools
import os

from hsdata.extract.capture import CaptureEvents

COMMITTED, FAILED, DROPPED = "hsdata_samples_committed", "hsdata_samples_failed", "hsdata_samples_dropped"


class PrometheusEvents(CaptureEvents):
    """A capture's events as prometheus counters (``_total`` is appended to each name on /metrics)."""

    def __init__(self):
        from prometheus_client import Counter

        self._committed = Counter(COMMITTED, "Samples the hsdata hook committed to its store")
        self._failed = Counter(FAILED, "Samples the hsdata hook lost to write faults", ["cause"])
        self._dropped = Counter(DROPPED, "Samples the hsdata hook dropped: the store was slower than the model")

    def committed(self, samples: int) -> None:
        self._committed.inc(samples)

    def failed(self, cause: str, samples: int) -> None:
        self._failed.labels(cause=cause).inc(samples)

    def dropped(self, samples: int) -> None:
        self._dropped.inc(samples)


@functools.cache  # one set of counters a process: prometheus refuses a name registered twice
def capture_events() -> CaptureEvents | None:
    """Counters on /metrics when this server publishes metrics, else None."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return None
    try:
        return PrometheusEvents()
    except ImportError:
        return None
