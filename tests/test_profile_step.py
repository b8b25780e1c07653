"""bench/profile_step.py's reading of a profile: steps cut at their first Triton kernel, the median time
and idle gap per position, and each kernel given the bytes of its recorded launch (others none)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.profile_step import step_rows, with_bytes


def _event(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_steps_are_cut_at_their_first_kernel_and_read_per_position() -> None:
    events = [_event("memcpy", 0, 1)]  # the tail of a step before the profile
    for step, (gemv_us, gap_us) in enumerate([(10, 2), (12, 4), (14, 3)]):
        start = 100 * step + 5
        events += [
            _event("_embedding_kernel", start, start + 1),
            _event("_gemv_kernel", start + 1 + gap_us, start + 1 + gap_us + gemv_us),
            _event("elementwise", start + 40, start + 41),
        ]
    events.append(_event("_embedding_kernel", 305, 306))  # a step cut short by the profile's end
    rows, totals = step_rows(events, "_embedding_kernel")
    assert [row["kernel"] for row in rows] == ["_embedding_kernel", "_gemv_kernel", "elementwise"]
    assert rows[1]["us"] == 12 and rows[1]["gap_us"] == 3  # the medians over the three whole steps
    assert rows[0]["gap_us"] == 59  # since the kernel before: the previous step's last (105 - 46)
    assert totals["launches"] == 3 and totals["steps_profiled"] == 3
    assert totals["step_us"] == 100  # from its first kernel's start to the next step's

    with_bytes(rows, [("_embedding_kernel", 2_000), ("_gemv_kernel", 1_200_000)], bandwidth=1e12)
    assert [row["bytes"] for row in rows] == [2_000, 1_200_000, None]
    assert rows[1]["share"] == pytest.approx(1_200_000 / 12e-6 / 1e12)
