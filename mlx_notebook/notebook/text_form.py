"""The plain-text forms of a generation: its status line, its text with that line, an error's first line.

Every view and the job magics print these; they read the handle only.

Example::

    print(status_line(gen))   # "#3 done · 12 tokens · 41.0 tok/s · TTFT 0.21 s"
"""

from __future__ import annotations

from ..generation.handle import Generation


def status_line(gen: Generation, ended_by: str = "") -> str:
    """One line: id, state, tokens, batch, ranks, tok/s, TTFT, peak memory, stop latency, error.

    Args:
        gen: The generation.
        ended_by: Why it ended, when not by itself or the user (``"kernel
          restarted"``): shown after the state. Default: ``""``.
    """
    s = gen.stats
    state = f"{gen.state}: {ended_by}" if ended_by else f"{gen.state}"
    parts = [f"#{gen.id} {state}", f"{s.generated_tokens} tokens"]
    if s.reasoning_tokens:
        parts.append(f"{s.reasoning_tokens} thinking")
    if s.cached_tokens:
        parts.append(f"{s.cached_tokens:,} cached")
    if s.batch_size > 1:
        parts.append(f"batch {s.batch_size}")
    if s.ranks > 1:
        parts.append(f"{s.ranks} ranks · {s.backend}" if s.backend else f"{s.ranks} ranks")
    if s.generation_tps:
        parts.append(f"{s.generation_tps:.1f} tok/s")
    if s.ttft_s is not None:
        parts.append(f"TTFT {s.ttft_s:.2f} s")
    if s.peak_memory_gb:
        parts.append(f"peak {s.peak_memory_gb * 1000:.0f} MB")
    if s.kv_bytes:
        parts.append(f"KV {s.kv_bytes / 1e6:,.1f} MB" + (f" ({s.kv})" if s.kv else ""))
    if s.stop_latency_s is not None:
        parts.append(f"stopped in {s.stop_latency_s * 1000:.0f} ms")
    if gen.error is not None:
        parts.append(f"error: {error_line(gen.error)}")
    return " · ".join(parts)


def error_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def thinking_line(gen: Generation) -> str:
    """How long it thought: ``thought for 312 tokens, 4.1 s`` (``thinking: ...`` while it does); ``""`` if it did not."""
    s = gen.stats
    if not s.reasoning_tokens and not gen.reasoning:
        return ""
    seconds = f", {s.reasoning_s:.1f} s" if s.reasoning_s is not None else ""
    verb = "thinking:" if gen.thinking else "thought for"
    return f"{verb} {s.reasoning_tokens} tokens{seconds}"


def plain_text(gen: Generation, ended_by: str = "", *, show_thinking: bool = False) -> str:
    """The ``text/plain`` form: how long it thought (the reasoning too with ``show_thinking``), the answer,
    then the status line in brackets."""
    head = ""
    if line := thinking_line(gen):
        head = f"[{line}]\n"
        if show_thinking and gen.reasoning.strip():
            head += f"{gen.reasoning.strip()}\n[end of thinking]\n"
        head += "\n"
    text = gen.text
    sep = "\n\n" if text else ""
    return f"{head}{text}{sep}[mlxgen {status_line(gen, ended_by)}]"
