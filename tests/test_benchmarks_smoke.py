"""The sampling benchmark runs end to end on the tiny model (a few tokens per option)."""

from __future__ import annotations

import json
import sys

from benchmarks import sampling


def test_sampling_benchmark_runs(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sampling.json"
    argv = ["sampling", "--model", tiny_model, "--prompt-length", "8", "--decode-tokens", "3", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    sampling.main()
    result = json.loads(out.read_text())
    measured = result["models"][tiny_model]["options"]
    assert list(measured) == [o.name for o in sampling.options(384)]
    for name, m in measured.items():
        assert m["tokens"] == [3], name  # EOS off: every run decodes every token, ours and mlx-lm's
        assert m["ratio"] > 0, name
    assert "| greedy |" in capsys.readouterr().out
