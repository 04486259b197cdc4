"""Where a round's Store keys and its exactly-once markers live, and which folders under a
run's store root are rounds of ours."""

from __future__ import annotations

import pytest

from coordinator.core.keys import RunKeys, encode_store_key
from coordinator.core.store_rounds import ops_prefix, round_of_folder, round_prefixes

KEYS = RunKeys("/etcd-elastic", "job42")


def test_markers_sit_beside_the_round_folder_not_in_it() -> None:
    store = KEYS.store_prefix(7)
    markers = ops_prefix(store)
    assert markers == b"/etcd-elastic/job42/store/7~ops/"
    assert not markers.startswith(store)  # num_keys/list_keys of round 7 never see them
    assert not KEYS.store_prefix(70).startswith(markers)
    # No encoded Store key can contain '~': no Store key is ever mistaken for a marker.
    assert b"~" not in encode_store_key("~ops/../~")
    assert round_prefixes(KEYS.store_root, 7) == [store, markers]


def test_ops_prefix_wants_a_folder() -> None:
    with pytest.raises(ValueError, match=r"^store prefix b'/x' must end with '/'$"):
        ops_prefix(b"/x")


@pytest.mark.parametrize(
    ("folder", "expected"),
    [
        (b"0", 0),
        (b"12", 12),
        (b"12~ops", 12),
        (b"012", None),
        (b"foreign", None),
        (b"12~ops~ops", None),
        (b"~ops", None),
        (b"-1", None),
        (b"", None),
    ],
)
def test_round_of_folder(folder: bytes, expected: int | None) -> None:
    assert round_of_folder(folder) == expected
