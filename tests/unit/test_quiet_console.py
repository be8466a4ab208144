"""A quiet start (issue 47): the per-stage memory tables go to <run dir>/memory_plan.txt and the console gets one
line that names the largest stage and the file."""

from __future__ import annotations

from asyncpp.job import MEMORY_PLAN_FILE, report_memory_plan


def test_the_memory_plan_is_one_console_line_and_a_file(tmp_path):
    said: list[str] = []
    plans = [(1, "stage 1 table\nrow", 3 * 2**30), (0, "stage 0 table\nrow", 2**30), (2, "stage 2 table", 2**29)]
    report_memory_plan(tmp_path, plans, said.append)
    line = ("memory plan: largest stage 1, 3.00 GiB per rank (per stage: 1.00, 3.00, 0.50); the tables: "
            f"{tmp_path / MEMORY_PLAN_FILE}")
    assert said == [line]
    written = (tmp_path / MEMORY_PLAN_FILE).read_text()
    assert written.index("stage 0 table") < written.index("stage 1 table") < written.index("stage 2 table")
    one: list[str] = []
    report_memory_plan(tmp_path, [(0, "only", 2**31)], one.append)
    assert one == [f"memory plan: largest stage 0, 2.00 GiB per rank; the tables: {tmp_path / MEMORY_PLAN_FILE}"]
