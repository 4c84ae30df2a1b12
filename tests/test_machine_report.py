"""The machine section of a failed test's report (testkit.machine) names what took the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit import machine

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_another_process_busy_meanwhile_is_counted_as_the_others_and_named() -> None:
    before = machine.take()
    subprocess.run(
        [sys.executable, "-c", "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"],
        check=True,
    )
    after = machine.take()
    assert before is not None and after is not None
    lines = machine.report(before, after).splitlines()
    others = float(lines[0].split("the others ")[1].split(";")[0])
    assert others >= 0.5, lines
    # The child ended before the second reading: the machine-wide counters still hold its time.
    assert "this process's threads: " in lines[2]
