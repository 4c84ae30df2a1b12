"""Two background ``%%mlxgen`` cells decoding at the same time, in JupyterLab with Chromium.

Both widgets must advance together (the second cell joins the first's batch
instead of waiting behind it), and Stop on one must leave the other running
to its end.
"""

from __future__ import annotations

import time

import pytest

from .lab_driver import Lab

pytestmark = pytest.mark.browser


def test_two_cells_decode_together_and_stop_of_one_leaves_the_other(lab: Lab) -> None:
    nb = lab.open(
        "batch.ipynb",
        [
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            "%%mlxgen -n 400\nWrite a long story about a lighthouse keeper.",
            "%%mlxgen -n 160\nList the planets of the solar system, one per line, with a fact each.",
        ],
    )
    nb.run(0)
    nb.run(1)
    nb.run(2)
    first, second = nb.widget(1), nb.widget(2)
    # Both advance while the other is still decoding.
    both = None
    deadline = time.monotonic() + 180
    while both is None:
        a, b = first.read(), second.read()
        if a is not None and b is not None and a.state == "decoding" and b.state == "decoding":
            if a.tokens >= 3 and b.tokens >= 3:
                both = (a, b)
        assert time.monotonic() < deadline, f"never both decoding: {a} / {b}"
        lab.page.wait_for_timeout(50)
    # Then both gain tokens, neither ending meanwhile.
    deadline = time.monotonic() + 60
    while True:
        a, b = first.read(), second.read()
        assert a is not None and b is not None
        assert a.state == "decoding" and b.state == "decoding", (a, b)
        if a.tokens > both[0].tokens and b.tokens > both[1].tokens:
            break
        assert time.monotonic() < deadline, f"not both advanced in 60 s: {both} -> {a} / {b}"
        lab.page.wait_for_timeout(50)
    # Stop the first: it ends stopped, the second goes on to its end.
    first.click_stop()
    stopped = first.wait_state("stopped", timeout=60)
    assert stopped.tokens < 400
    running = second.read()
    assert running is not None and running.state == "decoding", running
    done = second.wait_state("done", timeout=300)
    assert done.tokens == 160, done
    assert first.read().tokens == stopped.tokens  # nothing arrived after the stop
