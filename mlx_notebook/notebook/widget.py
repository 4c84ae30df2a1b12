"""The display of one generation: a widget with Stop / Pause-Resume, or plain text.

One view per generation. It listens to the :class:`~mlx_notebook.generation.handle.Generation`
(listeners run on the worker thread) and redraws from the handle's current
``text`` / ``state`` / ``stats``, never from event deltas, so a missed event
costs nothing and every redraw is correct. Redraws are throttled (``throttle``
seconds, default 0.1) except state changes, so display never slows generation.

Three kinds:

* :class:`WidgetView` (a live frontend): the streamed answer, **Stop** and
  **Pause/Resume** buttons enabled only when they apply, a progress bar for
  load and prefill then decode, a stats line and an outcome colour (green
  done, orange stopped, red failed), like ``tqdm.notebook``. The answer is
  Markdown rendered block by block (``format="markdown"``, see
  :mod:`.markdown_view`) or plain text in an ``HTML`` widget (``"text"``).
  Updates change trait values only (small comm messages), never
  ``Output.append_stdout``, which resends every output each time. With
  Markdown, the display becomes one plain Markdown output when it ends.
* :class:`TextView` (no widgets): a ``text/plain`` display updated in place
  (plus ``text/markdown`` at the end with ``format="markdown"``).
* :class:`TerminalView` (terminal IPython, no kernel): text printed as it comes
  when the cell waits; nothing in the background (it would garble the prompt).

Where the output goes (the starting cell while it runs, the running cell at
the end, again at the next cell for headless clients) is :mod:`.routing`'s
job; the plain-text forms (status line, text) are :mod:`.text_form`'s.

Example::

    view = make_view(gen, shell=get_ipython(), ui="auto")
    view.show()
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from ..generation.handle import Generation, GenerationEvent
from ..generation.states import State
from .disconnected import LIVE_CLASS, disconnected_note, live_state
from .logprobs_view import TAIL_ROWS, LogprobsTable
from .markdown_view import OUTCOME_COLOR, MarkdownArea, empty_note, final_markdown
from .routing import Bundle, DisplayRouter, current_parent, keep_frontend_subshell, msg_id, thread_parent
from .text_form import error_line as error_line  # cluster_magic imports it from here
from .text_form import plain_text, status_line, thinking_line
from .thinking_pane import ThinkingPane, thinking_details

UI_CHOICES = ("auto", "widget", "text")
FORMAT_CHOICES = ("markdown", "text")

# tqdm.notebook's convention: green done, orange stopped, red failed.
OUTCOME_STYLE = {State.DONE: "success", State.STOPPED: "warning", State.FAILED: "danger"}
METADATA_KEY = "mlx_notebook"

_NOTICE_STYLE = "font-size: 0.9em; color: var(--jp-warn-color0, #e65100)"
_PRE_STYLE = (
    "white-space: pre-wrap; word-break: break-word; margin: 0.25em 0; "
    "font-family: var(--jp-code-font-family, monospace); "
    "font-size: var(--jp-code-font-size, 13px); line-height: 1.4"
)


class GenerationView:
    """Shows one generation and keeps the display in step with it.

    Args:
        gen: The generation.
        shell: The IPython shell (``None`` outside IPython).
        throttle: Least seconds between two redraws while tokens stream.
          Default: ``0.1``.
        router: Re-sends final displays for headless clients. Default: ``None``.
        format: ``"markdown"`` or ``"text"``: how the answer is shown.
          Default: ``"text"`` (``MLXGen.format`` defaults to Markdown).
        notice: One line to show with this generation (e.g. a slow BLAS).
          Default: ``""``.
        show_thinking: Text forms show a reasoning model's reasoning in full,
          not one line. Default: ``False``.
    """

    def __init__(
        self,
        gen: Generation,
        *,
        shell: Any = None,
        throttle: float = 0.1,
        router: DisplayRouter | None = None,
        format: str = "text",
        notice: str = "",
        show_thinking: bool = False,
    ) -> None:
        self.gen = gen
        self.shell = shell
        self.throttle = throttle
        self.router = router
        self.format = format
        self.notice = notice
        self.show_thinking = show_thinking
        self.ended_by = ""  # why it ended when not by itself or the user
        self.handle: Any = None
        self.parent = current_parent(shell)
        self._lock = threading.RLock()
        self._last_draw = 0.0
        self._phase = ""
        self._phase_done = 0
        self._phase_total = 0
        # Only with --logprobs K: nothing is built or sent without it.
        self.logprobs = LogprobsTable(gen) if gen.request.logprobs > 0 else None

    # -- lifecycle ---------------------------------------------------------------

    def show(self) -> GenerationView:
        """Display the view in the current cell and start following the generation."""
        self._display()
        if self.router is not None:
            self.router.following(self)
        self.gen.add_listener(self.on_event)
        # The worker may have moved on, or even finished, before the listener was
        # added: draw from the handle now, and end properly if it is over.
        if self.gen.finished:
            self._finish()
        else:
            self.draw(final=False)
        return self

    def on_event(self, event: GenerationEvent) -> None:
        """The listener (worker thread): remember progress, redraw when due."""
        if event.kind == "progress":
            self._phase, self._phase_done, self._phase_total = event.phase, event.done, event.total
        if event.kind == "state" and event.state.final:
            self._finish()
            return
        now = time.monotonic()
        if event.kind != "state" and now - self._last_draw < self.throttle:
            return
        self._last_draw = now
        with thread_parent(self.shell, self.parent):
            self.draw(final=False)

    def _finish(self) -> None:
        with thread_parent(self.shell, self.parent):
            self.draw(final=True)
        self.publish_final()
        if self.router is not None:
            self.router.ended(self)
            if threading.current_thread() is not threading.main_thread():
                self.router.final_sent(self)
        self.gen.remove_listener(self.on_event)

    def end_now(self) -> None:
        """Show the last state now, even if the generation has not reported its end.

        For a kernel that exits with the worker still busy: the buttons go
        dead and the text so far stays, as the final output.
        """
        self.gen.remove_listener(self.on_event)
        self._finish()

    # -- for subclasses --------------------------------------------------------------

    def _display(self) -> None:
        raise NotImplementedError

    def draw(self, *, final: bool) -> None:
        """Bring the display up to date with the generation."""
        raise NotImplementedError

    def publish_final(self) -> None:
        """Send the final display with the calling thread's current parent."""

    # -- shared ----------------------------------------------------------------------

    def _metadata(self) -> dict[str, Any]:
        gen = self.gen
        # chars lets a reader cut the text from text/plain without the status line.
        return {METADATA_KEY: {"id": gen.id, "state": gen.state, "chars": len(gen.text)}}

    def status_text(self) -> str:
        """The status line (with why it ended, if not by itself)."""
        return status_line(self.gen, self.ended_by)

    def final_bundle(self) -> Bundle:
        """The display once it has ended: ``text/markdown`` (with ``format="markdown"``)
        and ``text/plain``, no widget: readable without widget state."""
        data = {"text/plain": self.plain_text(final=True)}
        if self.format == "markdown":
            # The reasoning folded above the answer, as <details>: readable without widget state.
            data["text/markdown"] = thinking_details(self.gen) + final_markdown(self.gen, self.status_text())
            if self.logprobs is not None and (table := self.logprobs.markdown()):
                data["text/markdown"] += f"\n{table}\n"
        return Bundle(data, self._metadata())

    def plain_text(self, *, final: bool) -> str:
        """The ``text/plain`` form; with log-probs, their table under it (the last rows until ``final``)."""
        text = plain_text(self.gen, self.ended_by, show_thinking=self.show_thinking)
        if self.logprobs is None:
            return text
        return f"{text}\n\n{self.logprobs.text(last=None if final else TAIL_ROWS)}"

    def progress_fraction(self) -> tuple[str, float]:
        """``(phase, fraction done)`` for the progress bar."""
        gen = self.gen
        state = gen.state
        if state is State.DECODING or gen.stats.generated_tokens:  # also paused or ended mid-decode
            return "decode", min(1.0, gen.stats.generated_tokens / max(1, gen.request.max_tokens))
        if self._phase and self._phase_total:
            return self._phase, min(1.0, self._phase_done / self._phase_total)
        return state.value, 0.0


class TextView(GenerationView):
    """A ``text/plain`` display updated in place (no widget frontend)."""

    def _bundle(self, final: bool = False) -> Bundle:
        # Markdown only at the end: each update re-renders all of it, and a
        # client without widgets cannot do better, so it streams as plain text.
        if final:
            return self.final_bundle()
        return Bundle({"text/plain": self.plain_text(final=False)}, self._metadata())

    def _display(self) -> None:
        from IPython.display import display

        self.handle = display(self._bundle(), display_id=True)

    def draw(self, *, final: bool) -> None:
        with self._lock:
            if self.handle is not None:
                self.handle.update(self._bundle(final or self.gen.finished))

    def publish_final(self) -> None:
        # The final draw went to the starting cell; a headless client may be
        # reading another cell by now, so send it with the current parent too.
        if msg_id(current_parent(self.shell)) != msg_id(self.parent):
            self.draw(final=True)


class WidgetView(GenerationView):
    """Streamed text, Stop and Pause/Resume buttons, progress, stats, outcome colour."""

    def __init__(self, gen: Generation, **kwargs: Any) -> None:
        super().__init__(gen, **kwargs)
        import ipywidgets as w

        # The answer: Markdown blocks in Output widgets, or plain text in HTML.
        self.markdown = MarkdownArea() if self.format == "markdown" else None
        self.text = w.HTML(value="")
        self.stop_button = w.Button(
            description="Stop", icon="stop", tooltip="Stop this generation; the model stays loaded"
        )
        self.pause_button = w.Button(description="Pause", icon="pause", tooltip="Pause; Resume continues exactly")
        self.progress = w.FloatProgress(
            value=0.0,
            min=0.0,
            max=1.0,
            description="queued",
            style={"description_width": "initial"},  # "load: dequantizing" in full
            layout=w.Layout(flex="1 1 auto", min_width="12em"),
        )
        # Made before the stats line: readers of the comm state take the last plain HTML as it.
        self.logprobs_html = w.HTML(value="") if self.logprobs is not None else None
        self.status = w.HTML(value="")
        controls = w.HBox(
            [self.stop_button, self.pause_button, self.progress],
            layout=w.Layout(align_items="center"),
        )
        controls.add_class(LIVE_CLASS)  # hidden once the kernel is gone (see .disconnected)
        answer = self.markdown.box if self.markdown is not None else self.text
        # A reasoning model's thinking, above the answer (an empty box for other models).
        self.thinking = ThinkingPane()
        parts = [controls, self.thinking.box, answer, self.status, disconnected_note()]
        if self.logprobs_html is not None:
            parts.insert(3, self.logprobs_html)
        if self.notice:
            parts.append(
                w.HTML(value=f'<span class="mlxgen-notice" style="{_NOTICE_STYLE}">{html.escape(self.notice)}</span>')
            )
        self.box = w.VBox(parts)
        self.box.add_class("mlxgen")
        self.stop_button.on_click(self._on_stop_click)
        self.pause_button.on_click(self._on_pause_click)
        for button in (self.stop_button, self.pause_button):
            keep_frontend_subshell(button)

    # -- clicks (main thread, from the frontend's comm messages) -----------------------

    def _on_stop_click(self, button: Any) -> None:
        self.gen.cancel()
        self._redraw()

    def _redraw(self) -> None:
        # With the cell's parent: a widget made in this draw (the Thinking pane) opens in that cell.
        with thread_parent(self.shell, self.parent):
            self.draw(final=self.gen.finished)

    def _on_pause_click(self, button: Any) -> None:
        gen = self.gen
        if gen.state is State.PAUSED:
            gen.resume()
        elif gen.state.running:
            gen.pause()
        self._redraw()

    # -- drawing -------------------------------------------------------------------------

    def _bundle(self) -> Bundle:
        data = dict(self.box._repr_mimebundle_())
        data["text/plain"] = self.plain_text(final=self.gen.finished)
        return Bundle(data, self._metadata())

    def _display(self) -> None:
        from IPython.display import display

        self.draw(final=False)
        self.handle = display(self._bundle(), display_id=True)

    def draw(self, *, final: bool) -> None:
        gen = self.gen
        with self._lock:
            state = gen.state
            final = final or state.final
            phase, fraction = self.progress_fraction()
            # Contexts exit in reverse: the text goes out first and the stats
            # line last, so "done" never shows beside text missing its tail.
            with (
                self.box.hold_sync(),
                self.status.hold_sync(),
                self.progress.hold_sync(),
                self.stop_button.hold_sync(),
                self.pause_button.hold_sync(),
                self.text.hold_sync(),
            ):
                self.thinking.update(gen)
                self._draw_answer(final)
                if self.logprobs is not None and self.logprobs_html is not None:
                    self.logprobs_html.value = self.logprobs.html(final=final)
                self._draw_buttons(state, final)
                self.progress.description = phase
                self.progress.value = 1.0 if state is State.DONE else fraction
                self.progress.bar_style = OUTCOME_STYLE.get(state, "info" if not final else "")
                color = OUTCOME_COLOR.get(state, "inherit")
                line = html.escape(self.status_text())
                if not final and not self.ended_by:
                    # A live state word, replaced by "ended" once the kernel is gone (see .disconnected).
                    head = f"#{gen.id} {state}"
                    line = line.replace(head, f"#{gen.id} {live_state(str(state))}", 1)
                self.status.value = (
                    f'<span class="mlxgen-status" style="color: {color}; font-size: 0.9em">{line}</span>'
                )

    def _draw_answer(self, final: bool) -> None:
        text = self.gen.text
        # Ended with nothing to show: say so rather than leave a gap.
        empty = final and not text.strip()
        if self.markdown is not None:
            self.markdown.update(text, placeholder=empty_note(self.gen) if empty else "")
            return
        note = (
            f'<div class="mlxgen-empty" style="opacity: 0.6"><i>{html.escape(empty_note(self.gen))}</i></div>'
            if empty
            else ""
        )
        # Tooltips once it ends: per tick they would resend K alternatives per token.
        shown = self.logprobs.hover(text) if final and self.logprobs is not None else html.escape(text)
        self.text.value = f'<pre style="{_PRE_STYLE}">{shown}</pre>{note}'

    def _draw_buttons(self, state: State, final: bool) -> None:
        token = self.gen.token
        final = final or bool(self.ended_by)  # the kernel is going: no click can reach it
        stopping = token.cancelled and not final
        self.stop_button.description = "Stopping…" if stopping else "Stop"
        self.stop_button.disabled = final or stopping or not state.stoppable
        pause = self.pause_button
        if state is State.PAUSED and not stopping:
            pause.description, pause.icon, pause.disabled = "Resume", "play", False
        elif state.running and token.pause_requested and not stopping:
            # Requested, not yet in effect: the worker pauses at its next checkpoint.
            pause.description, pause.icon, pause.disabled = "Pausing…", "pause", True
        else:
            pause.description, pause.icon = "Pause", "pause"
            pause.disabled = stopping or not state.running

    def publish_final(self) -> None:
        # One update of the whole bundle: live frontends redraw the same widget,
        # headless ones store the final text/plain (see the module docstring).
        # With Markdown the widget makes way for the answer as one Markdown output.
        with self._lock:
            if self.handle is not None:
                self.handle.update(self.final_bundle() if self.format == "markdown" else self._bundle())


class TerminalView(GenerationView):
    """Terminal IPython: print the text as it comes while the cell waits."""

    def __init__(self, gen: Generation, *, stream: bool = False, **kwargs: Any) -> None:
        super().__init__(gen, **kwargs)
        self.stream = stream
        self._printed = 0
        self._thought = 0
        self._said_thought = False

    def _display(self) -> None:
        if self.notice:
            print(self.notice)
        if not self.stream:
            print(
                f"mlxgen #{self.gen.id} runs in the background: %mlxgen_jobs shows it, "
                f"%mlxgen_stop {self.gen.id} stops it, --out NAME binds its handle"
            )

    def draw(self, *, final: bool) -> None:
        if not self.stream:
            return
        with self._lock:
            gen = self.gen
            if self.show_thinking:
                reasoning = gen.reasoning
                print(reasoning[self._thought :], end="", flush=True)
                self._thought = len(reasoning)
            text = gen.text
            if (text or final) and not self._said_thought and (line := thinking_line(gen)):
                # One line before the answer; the reasoning itself only with show_thinking.
                self._said_thought = True
                print(f"{chr(10) if self.show_thinking else ''}[{line}]", flush=True)
            print(text[self._printed :], end="", flush=True)
            self._printed = len(text)
            if final:
                print(f"\n[mlxgen {self.status_text()}]", flush=True)
                if self.logprobs is not None:
                    print(self.logprobs.text(), flush=True)


def widgets_available() -> bool:
    """Whether ``ipywidgets`` imports (it is a dependency, but may be broken)."""
    try:
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


def choose_ui(ui: str, shell: Any) -> str:
    """Resolve ``auto`` to ``widget``, ``text`` or ``terminal`` for this shell.

    Args:
        ui: ``"auto"``, ``"widget"`` or ``"text"``.
        shell: The IPython shell.

    Returns:
        ``"terminal"`` outside a kernel (whatever was asked), ``"text"`` when
        asked or when ipywidgets is missing, else ``"widget"``.
    """
    if getattr(shell, "kernel", None) is None:
        return "terminal"
    if ui == "text" or not widgets_available():
        return "text"
    return "widget"


def make_view(
    gen: Generation,
    *,
    shell: Any,
    ui: str = "auto",
    throttle: float = 0.1,
    router: DisplayRouter | None = None,
    waiting: bool = False,
    format: str = "text",
    notice: str = "",
    show_thinking: bool = False,
) -> GenerationView:
    """The right view for this shell and setting (not shown yet: call ``show()``).

    Args:
        gen: The generation.
        shell: The IPython shell.
        ui: ``"auto"``, ``"widget"`` or ``"text"``. Default: ``"auto"``.
        throttle: Least seconds between redraws. Default: ``0.1``.
        router: See :class:`DisplayRouter`. Default: ``None``.
        waiting: Whether the cell blocks on it (terminal views print then).
          Default: ``False``.
        format: ``"markdown"`` or ``"text"``. Default: ``"text"``.
        notice: One line to show with it. Default: ``""``.
        show_thinking: Text forms show the reasoning in full. Default: ``False``.
    """
    kind = choose_ui(ui, shell)
    kwargs: dict[str, Any] = dict(
        shell=shell, throttle=throttle, router=router, format=format, notice=notice, show_thinking=show_thinking
    )
    if kind == "terminal":
        return TerminalView(gen, stream=waiting, **kwargs)
    if kind == "text":
        return TextView(gen, **kwargs)
    return WidgetView(gen, **kwargs)
