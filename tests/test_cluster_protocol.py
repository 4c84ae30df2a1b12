"""The cluster's wire: every message and the job survive a round trip; a foreign message is refused in one line."""

from __future__ import annotations

import pytest

from mlx_notebook.cluster import protocol as p
from mlx_notebook.generation.request import GenerationRequest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "message",
    [
        p.Generate(1, p.request_fields(GenerationRequest("hi", max_tokens=3))),
        p.Control(2, "pause"),
        p.Seen(3, 17),
        p.Ping(),
        p.Shutdown(),
        p.Ready(2, "ring", "/m", 1.5, 1024),
        p.FailedStart("no such file"),
        p.Pong(),
        p.StateChanged(4, "decoding"),
        p.Reasoning(4, "<think>", "</think>", [7], [8], True),
        p.Progress(5, "prefill", 10, 20),
        p.Tokens(6, [1, 2], "ab"),
        p.Stats(7, {"generated_tokens": 3}),
        p.Finish(8, "failed", "boom", lost=True),
    ],
    ids=lambda m: type(m).__name__,
)
def test_message_round_trip(message):
    assert p.unpack(p.pack(message)) == message


def test_request_crosses_once_with_its_types():
    request = GenerationRequest(
        [3, 4, 5], model="/not/sent", max_tokens=9, temperature=0.5, seed=2, logit_bias={12: -3.5}, stop_budget=0.02
    )
    job = p.Job(11, request)
    back = p.Job.decode(job.encode())
    assert back.id == 11 and back.prompt == [3, 4, 5]
    assert back.request.logit_bias == {12: -3.5}  # JSON keys are strings; the ids come back as ints
    assert back.request.model is None and back.request.stop_budget == 0.02 and back.request.seed == 2


def test_foreign_message_is_one_line():
    with pytest.raises(ValueError, match="not an mlx-notebook cluster message"):
        p.unpack(b'{"op": "generate"}')
