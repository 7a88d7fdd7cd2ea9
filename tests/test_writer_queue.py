"""The writer's hand-off queue bounds memory: producers wait while too many bytes are pending."""

from __future__ import annotations

import threading

import pytest

import hsdata
from hsdata.writer import _PendingQueue


def test_put_blocks_until_the_writer_releases_bytes():
    queue = _PendingQueue(max_bytes=100)
    queue.put(("sample", "a"), 60)
    second_done = threading.Event()
    producer = threading.Thread(target=lambda: (queue.put(("sample", "b"), 60), second_done.set()))
    producer.start()
    assert not second_done.wait(0.2)  # 120 > 100 bytes: the producer waits
    item, nbytes = queue.get()
    assert item == ("sample", "a")
    queue.release(nbytes)
    assert second_done.wait(5)
    producer.join()


def test_an_oversized_sample_is_admitted_alone():
    queue = _PendingQueue(max_bytes=10)
    queue.put(("sample", "huge"), 1000)  # nothing pending: admitted, or it could never be written
    assert queue.get() == (("sample", "huge"), 1000)


def test_failure_wakes_a_waiting_producer():
    queue = _PendingQueue(max_bytes=10)
    queue.put(("sample", "a"), 10)
    errors = []

    def produce():
        try:
            queue.put(("sample", "b"), 10)
        except hsdata.WriterError as e:
            errors.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    queue.fail(OSError("disk full"))
    producer.join(5)
    assert len(errors) == 1 and "disk full" in str(errors[0])


def test_writer_rejects_a_nonpositive_bound(store_path):
    with pytest.raises(ValueError, match="max_pending_bytes must be positive"):
        hsdata.create(str(store_path), hidden_size=8, aux_layers=[1], max_pending_bytes=0)
    assert not store_path.exists()
