"""``put_newest``: the bounded memory of the agents, the learner, the endpoint and the views (pure)."""

from __future__ import annotations

from collections import OrderedDict

from coevo.algorithm.recent import put_newest


def test_the_oldest_keys_are_forgotten_and_returned_and_a_key_put_again_is_the_newest() -> None:
    d: OrderedDict[str, int] = OrderedDict()
    assert [put_newest(d, k, i, 3) for i, k in enumerate("abc")] == [[], [], []]
    assert put_newest(d, "a", 10, 3) == []  # put again: the newest, nothing forgotten
    assert list(d.items()) == [("b", 1), ("c", 2), ("a", 10)]
    assert put_newest(d, "d", 3, 3) == [("b", 1)]  # b, not a, was the oldest
    assert put_newest(d, "e", 4, 1) == [("c", 2), ("a", 10), ("d", 3)]  # a smaller limit forgets oldest first
    assert list(d) == ["e"]
    assert put_newest(d, "f", 5, 0) == [("e", 4), ("f", 5)] and not d  # limit 0 keeps nothing
