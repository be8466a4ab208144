"""Pipeline schedules as pure data: per-stage action lists, their invariants and a cost model.

Nothing here imports torch or touches a process group; the engine executes what these return.
"""

from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import KINDS, build_pipeline, build_schedule
from asyncpp.schedules.invariants import (
    DeadlockError,
    ScheduleError,
    check_schedules,
    max_versions_for,
    peak_in_flight,
    peak_versions,
)

__all__ = [
    "KINDS",
    "Action",
    "DeadlockError",
    "Op",
    "ScheduleError",
    "build_pipeline",
    "build_schedule",
    "check_schedules",
    "max_versions_for",
    "peak_in_flight",
    "peak_versions",
]
