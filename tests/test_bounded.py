"""The one bounded set/map: insertion order, the oldest forgotten first, refresh on demand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.runtime.bounded import BoundedMap, BoundedSet


def test_a_set_forgets_its_oldest_key_and_says_what_it_knew() -> None:
    seen = BoundedSet(2)
    assert [seen.add(k) for k in ("a", "b", "a")] == [True, True, False]
    assert seen.add("c")  # "a" goes
    assert ("a" in seen, "b" in seen, "c" in seen, len(seen)) == (False, True, True, 2)


def test_refresh_keeps_a_repeated_key_and_discard_forgets_it() -> None:
    seen = BoundedSet(2)
    seen.add("a")
    seen.add("b")
    assert not seen.add("a", refresh=True)  # "a" is the newest now
    seen.add("c")  # so "b" goes
    assert ("a" in seen, "b" in seen) == (True, False)
    seen.discard("a")
    seen.discard("never")
    assert "a" not in seen


def test_a_map_keeps_its_last_values() -> None:
    kept: BoundedMap[str, int] = BoundedMap(2)
    for i, key in enumerate("xyz"):
        kept[key] = i
    assert list(kept.items()) == [("y", 1), ("z", 2)]
    with pytest.raises(ValueError, match="at least 1"):
        BoundedMap(0)


@given(st.lists(st.integers(0, 20)), st.integers(1, 8))
def test_never_more_than_the_limit_and_always_the_newest(keys: list[int], limit: int) -> None:
    seen = BoundedSet(limit)
    for key in keys:
        seen.add(key)
    assert len(seen) <= limit
    if keys:
        assert keys[-1] in seen
