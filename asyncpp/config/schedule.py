"""schedule.*: the pipeline schedule's name (the registry in asyncpp/schedules checks which (P, m) it serves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncpp.schedules.registry import SYNC_KINDS

ScheduleName = Literal["sync", "gpipe", "1f1b", "2bw", "pipedream"]


#: Schedules whose mathematics is synchronous training (they differ only in how a pipeline orders work).
SYNC_SCHEDULES = SYNC_KINDS


@dataclass(kw_only=True)
class ScheduleConfig:
    name: ScheduleName = "2bw"
