"""The comm modes by name: the one place that imports every dispatcher, so that the dispatchers' modules import
each other in one direction only (two_phase builds on dispatcher)."""
from __future__ import annotations

from .dispatcher import DirectDispatcher, Dispatcher
from .two_phase import AutoDispatcher, TwoPhaseDispatcher

DISPATCHERS: dict[str, type[Dispatcher]] = {"direct": DirectDispatcher, "two_phase": TwoPhaseDispatcher,
                                            "auto": AutoDispatcher}


def make_dispatcher(mode: str, **kwargs) -> Dispatcher:
    """direct / two_phase / auto (auto needs model=CostModel)."""
    if mode not in DISPATCHERS:
        raise ValueError(f"comm mode {mode!r} is not available; choose one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[mode](**kwargs)
