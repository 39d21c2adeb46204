"""PostedByKey (twellsparse/_posted.py): one posted scalar per recurring call, the least
recently used dropped beyond its slots. Host numbers stand in for device scalars (PostedScalar
records them as they are), so this runs on the CPU."""

from __future__ import annotations

import threading

from twellsparse._posted import PostedByKey, PostedScalar


def test_a_key_keeps_its_scalar_and_its_value():
    posted = PostedByKey()
    first = posted.get(("w", 1))
    assert isinstance(first, PostedScalar) and first.value() is None
    first.post(0.25, scale=0.5)
    again = posted.get(("w", 1))
    assert again is first and again.value() == 0.125
    other = posted.get(("w", 2))
    assert other is not first and other.value() is None and len(posted) == 2


def test_the_least_recently_used_key_goes_beyond_the_slots():
    posted = PostedByKey(slots=3)
    scalars = {k: posted.get(k) for k in "abc"}
    for k, s in scalars.items():
        s.post(ord(k))
    posted.get("a")  # used again: "b" is now the oldest
    posted.get("d")
    assert len(posted) == 3
    assert posted.get("a") is scalars["a"] and posted.get("c") is scalars["c"]
    fresh = posted.get("b")  # dropped, so made anew (and "d" now the oldest)
    assert fresh is not scalars["b"] and fresh.value() is None


def test_threads_get_one_scalar_per_key():
    posted = PostedByKey(slots=1000)
    got: list[list[PostedScalar]] = [[] for _ in range(8)]

    def work(i: int) -> None:
        got[i] = [posted.get(k % 50) for k in range(500)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(posted) == 50
    for row in got:
        assert all(s is posted.get(k % 50) for k, s in enumerate(row))
