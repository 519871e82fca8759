"""The throughput-latency frontier: which measured points no other point beats on both at once.

A point (latency, throughput) is on the frontier when no other point has at most its latency and at least its
throughput, one of the two strictly. Serving configurations (engine, engine settings, load) are compared this way:
the frontier is every answer to "the most throughput at my latency target" for some target, and a point off it is
beaten by one on it at any target (vLLM's `bench sweep` plots the same).
"""

from __future__ import annotations

from typing import Sequence


def on_frontier(points: Sequence[tuple[float | None, float | None]]) -> list[bool]:
    """For (latency, throughput) pairs, whether each is on the frontier; a pair with a missing figure never is."""
    known = [(lat, thr) for lat, thr in points if lat is not None and thr is not None]

    def beaten(lat: float, thr: float) -> bool:
        return any(o_lat <= lat and o_thr >= thr and (o_lat < lat or o_thr > thr) for o_lat, o_thr in known)

    return [lat is not None and thr is not None and not beaten(lat, thr) for lat, thr in points]
