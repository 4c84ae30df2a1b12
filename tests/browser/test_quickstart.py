"""notebooks/quickstart.ipynb, run in JupyterLab from the Run menu, shows what it says."""

from __future__ import annotations

import re

import nbformat
import pytest

from .lab_driver import REPO, Lab

pytestmark = pytest.mark.browser


def test_quickstart_runs_in_jupyterlab(lab: Lab) -> None:
    path = lab.copy_notebook(REPO / "notebooks" / "quickstart.ipynb")
    cells = nbformat.read(str(path), as_version=4).cells
    sources = [c.source for c in cells]
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    nb = lab.open("quickstart.ipynb")
    assert nb.cells.count() == len(cells)

    def find(fragment: str) -> int:
        (index,) = [i for i in code if fragment in sources[i]]
        return index

    nb.run(code[0])  # %load_ext (run on its own: the first Run after a kernel start may need a retry)
    nb.select(code[1])
    nb.menu("Run", "Run Selected Cell and All Below")
    for i in code[1:]:
        nb.wait_done(i, timeout=240)
    for i in code:
        text = nb.output_text(i)
        assert not re.search(r"Traceback|Error\b|UsageError", text), (sources[i], text)

    first = nb.widget(find("-o first")).settle()
    assert (first.state, first.tokens) == ("done", 24), first
    fact = nb.widget(find("-o fact")).settle()
    assert (fact.state, fact.tokens) == ("done", 20) and fact.text.strip(), fact
    story = nb.widget(find("-o story")).settle()
    assert (story.state, story.tokens) == ("done", 48), story
    assert re.search(r"paused: paused after \d+ tokens", nb.output_text(find("story.pause()")))
    long = nb.widget(find("-o long")).settle()
    assert long.state == "stopped" and long.stop_ms is not None, long
    assert re.search(r"stopped after \d+ tokens\s+the stop took \d+ ms", nb.output_text(find("%mlxgen_stop")))
    jobs = nb.output_text(find("%mlxgen_jobs"))
    assert re.search(r"#1\s+done\s+24", jobs) and re.search(r"#4\s+stopped", jobs), jobs
    assert nb.kernel_status() == "idle" and nb.dialogs() == []
