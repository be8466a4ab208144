"""torchrun's own stderr, condensed: what launch.local prints of it (the ranks' output passes through unchanged).

torchrun (its elastic agent) writes, beside the ranks' output on the same stderr:
- a 4-line OMP_NUM_THREADS banner at every start;
- on a stop signal, "Received 15 death signal" and one "Sending process N closing signal" line per rank, then its own
  ~25-line SignalException traceback (torchrun re-raises the signal it forwarded);
- on a rank's non-zero exit, a "failed (exitcode: N)" line, then its ~20-line traceback and a ~20-line
  ChildFailedError report (every failed rank's time, host, rank, exit code, pid, error file).
None of it can be silenced in torchrun without a zero exit code (which would tell `set -e` scripts and Slurm that a
refused or crashed run succeeded): so launch.local keeps torchrun's exit code and prints each of these as one line.
A line is torchrun's only when it is in torchrun's log format from torch/distributed/run.py or elastic/, or inside a
traceback that ends in torchrun's SignalException or ChildFailedError; everything else, a rank's traceback
included, is passed on as it came. No torch import here.
"""

from __future__ import annotations

import re

TAG = "[torchrun]"
_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ \d+ torch/distributed/(?:run\.py|elastic/)\S*\] ?(.*)$")
_SIGNAL = "torch.distributed.elastic.multiprocessing.api.SignalException:"
_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
_RULE = re.compile(r"^={20,}\s*$")
_FIELD = re.compile(r"^\s+(rank|exitcode)\s*:\s*(-?\d+)")
MAX_BLOCK = 400
"""A traceback longer than this is no torchrun report (its are ~25 lines): passed on as it came."""


class TorchrunReport:
    """feed(line) -> the lines to print now; close() -> what is still held. Lines keep their newline."""

    def __init__(self) -> None:
        self._block: list[str] = []  # a traceback being read: torchrun's (condensed) or a rank's (passed on)
        self._report: list[str] | None = None  # inside ChildFailedError's ===== report
        self._failures: list[tuple[int, int]] = []  # (rank, exit code) in the report's order; the root cause last
        self.program = ""

    def feed(self, line: str) -> list[str]:
        if self._report is not None:
            return self._feed_report(line)
        if self._block:
            return self._feed_traceback(line)
        if line.startswith("Traceback (most recent call last):"):
            self._block = [line]
            return []
        found = _LOG.match(line.rstrip("\n"))
        return [line] if found is None else self._log_line(found.group(1))

    def close(self) -> list[str]:
        held = self._block + (self._report or [])
        self._block, self._report = [], None
        return held

    def _log_line(self, message: str) -> list[str]:
        if message.startswith("Setting OMP_NUM_THREADS"):
            return [f"{TAG} OMP_NUM_THREADS=1 for every rank (torchrun's default; set OMP_NUM_THREADS to change it)\n"]
        death = re.match(r"Received (\S+) death signal", message)
        if death:
            return [f"{TAG} got signal {death.group(1)}: passed on to the ranks, waiting for them to stop\n"]
        failed = re.match(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", message)
        if failed:  # the report at the end says it for every rank
            return []
        if message.startswith("Sending process") or not message.strip("* "):
            return []  # one per rank after the death-signal line; the banner's rules
        return [f"{TAG} {message}\n"]

    def _feed_traceback(self, line: str) -> list[str]:
        self._block.append(line)
        if line.startswith((" ", "\t")) and len(self._block) < MAX_BLOCK:
            return []  # a frame, its source line or its carets
        block, self._block = self._block, []
        if line.startswith(_SIGNAL):
            number = re.search(r"got signal: (-?\d+)", line)
            said = number.group(1) if number else "?"
            return [f"{TAG} exited on signal {said} after its ranks did (its SignalException traceback left out)\n"]
        if line.startswith(_FAILED):
            self._report, self._failures = [*block], []
            return []
        return block  # a rank's own traceback, or something else: as it came

    def _feed_report(self, line: str) -> list[str]:
        self._report.append(line)
        if len(self._report) > MAX_BLOCK:
            return self.close()
        rules = sum(bool(_RULE.match(x)) for x in self._report)
        if rules == 1 and _RULE.match(line):
            return []
        if rules == 1 and not self.program and line.strip().endswith("FAILED"):
            self.program = line.strip()[: -len("FAILED")].strip()
        field = _FIELD.match(line)
        if field and field.group(1) == "rank":
            self._failures.append((int(field.group(2)), 0))
        elif field and self._failures:
            self._failures[-1] = (self._failures[-1][0], int(field.group(2)))
        if rules < 2:
            return []
        self._report = None
        return [self._summary()]

    def _summary(self) -> str:
        if not self._failures:
            return f"{TAG} {self.program or 'the program'} failed (its ChildFailedError report left out)\n"
        *others, (root, code) = self._failures  # torchrun lists the root cause (first failure) last
        rest = "".join(f", rank {r} exit {c}" for r, c in sorted(others))
        return (f"{TAG} {self.program or 'the program'} failed: rank {root} exited with {code} first{rest} (the "
                "ranks' own output is above; torchrun's ChildFailedError report left out)\n")
