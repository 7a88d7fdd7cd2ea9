"""The commands' one progress style: status lines at once, then a tqdm bar, on stderr when it is a terminal."""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

BAR_FORMAT = "{l_bar}{bar}| {n_fmt}{unit}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def status(message: str) -> None:
    """Say what the command is doing now: one line on stderr, at once, on a terminal (like the bars; so that
    piped stderr holds only errors)."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, as every summary and bar shows them (``3.2 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError


class Progress:
    """A thread-safe bar of ``total`` units, with rate and ETA.

    ``unit="B"`` counts bytes in binary units (KiB, MiB, like the summaries). ``samples``: a total of samples
    counted alongside the units (shown as done/total); ``unit_bytes``: bytes written per unit (shown as GiB/s).
    """

    def __init__(self, desc: str, *, unit: str, total: int | None = None, samples: int | None = None,
                 unit_bytes: int = 0):
        binary = unit == "B"  # tqdm writes prefix + unit: "iB" makes its 1024-based "M" read "MiB"
        self._bar = tqdm(total=total, desc=desc, unit="iB" if binary else unit, unit_scale=True, disable=None,
                         file=sys.stderr, unit_divisor=1024 if binary else 1000, bar_format=BAR_FORMAT)
        self._lock = threading.Lock()
        self._samples, self._samples_total = 0, samples
        self._unit_bytes = unit_bytes
        self._started = time.monotonic()

    def set_total(self, total: int) -> None:
        with self._lock:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int, samples: int = 0) -> None:
        with self._lock:
            self._samples += samples
            extra = []
            if self._samples_total is not None:
                extra.append(f"{self._samples:,}/{self._samples_total:,} samples")
            if self._unit_bytes:
                seconds = max(time.monotonic() - self._started, 1e-9)
                extra.append(f"{human_bytes((self._bar.n + n) * self._unit_bytes / seconds)}/s written")
            if extra:
                self._bar.set_postfix_str(", ".join(extra), refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
