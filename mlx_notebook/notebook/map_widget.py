"""The display of a ``%%mlxgen --map``: one compact view for a whole :class:`~mlx_notebook.many.Batch`.

Three kinds, chosen like a single generation's (:func:`.widget.choose_ui`):

* :class:`MapWidgetView` (a live frontend): **Stop all** and **Pause all** /
  **Resume all**, an overall progress bar and a summary line, then one row
  per input: its own **Stop** button and a line with its index, id, state,
  tokens and the first words of its text (the whole text on hover).
* :class:`MapTextView` (no widgets): a ``text/plain`` display updated in place.
* :class:`MapTerminalView` (terminal IPython): each result printed as it
  finishes when the cell waits.

Like :class:`.widget.WidgetView`, a view redraws from the handles, never
from event deltas, throttled except on state changes, and its display bundle
always carries ``text/plain``: the summary and the text of every finished
input. Each time an input finishes that bundle goes out again with the
kernel's *current* parent (at most once a second, and always when the last
one ends), so headless clients (nbclient, papermill) store each result as it
finishes, even while they run later cells; live frontends keep the widget.

Example::

    view = make_map_view(batch, shell=get_ipython(), ui="auto")
    view.show()
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any, cast

from ..generation.handle import Generation, GenerationEvent
from ..generation.states import State
from ..many import Batch
from .routing import Bundle, DisplayRouter, current_parent, keep_frontend_subshell, msg_id, thread_parent
from .structured import parsed_table_html, parsed_table_text
from .text_form import error_line, thinking_line
from .widget import METADATA_KEY, OUTCOME_COLOR, OUTCOME_STYLE, choose_ui

MAP_METADATA_KEY = METADATA_KEY + "_map"
PREVIEW_CHARS = 60
# A row per input up to here; a widget of thousands of rows would stall the
# browser, and the Batch (-o NAME) holds every member anyway.
MAX_ROWS = 100
# Least seconds between two re-sends of the whole bundle while inputs finish:
# a live frontend re-renders the widget on each one.
PUBLISH_INTERVAL_S = 1.0


# -- text, shared by every kind (no widgets here) -------------------------------------------


def preview(text: str, chars: int = PREVIEW_CHARS) -> str:
    """The first ``chars`` characters of ``text`` on one line (``…`` when cut)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"


def row_line(index: int, gen: Generation) -> str:
    """One input's line: ``[2] #7 decoding · 12 tokens · The Danube flows…``."""
    parts = [f"[{index}] #{gen.id} {gen.state}", f"{gen.stats.generated_tokens} tokens"]
    if gen.error is not None:
        parts.append(f"error: {error_line(gen.error)}")
    elif gen.text:
        parts.append(preview(gen.text))  # the answer: a reasoning model's thinking is not previewed
    elif line := thinking_line(gen):
        parts.append(line)
    return " · ".join(parts)


def overall_fraction(batch: Batch) -> float:
    """How far the whole map is: finished inputs count 1, running ones their share of ``max_tokens``."""
    done = sum(
        1.0 if gen.state.final else min(1.0, gen.stats.generated_tokens / max(1, gen.request.max_tokens))
        for gen in batch
    )
    return done / len(batch)


def outcome(batch: Batch) -> State | None:
    """The map's outcome once every input ended: failed, else stopped, else done."""
    states = set(batch.states)
    if not all(state.final for state in states):
        return None
    for state in (State.FAILED, State.STOPPED):
        if state in states:
            return state
    return State.DONE


def map_plain_text(batch: Batch) -> tuple[str, list[dict[str, Any]]]:
    """The ``text/plain`` form and, per input, where its text sits in it.

    Returns:
        ``(text, entries)``: the summary line, then each input's line and,
        once it finished, its whole text; ``entries[i]`` holds the input's
        ``id``, ``state`` and the ``start`` / ``end`` offsets of its text
        (equal while it runs).
    """
    out = [f"[mlxgen map: {batch.summary()}]"]
    entries = []
    size = len(out[0])
    for index, gen in enumerate(batch):
        line = f"\n\n[{index}] #{gen.id} {gen.state} · {gen.stats.generated_tokens} tokens"
        if gen.error is not None:
            line += f" · error: {error_line(gen.error)}"
        text = gen.text if gen.state.final else ""
        start = size + len(line) + 1
        out.append(f"{line}\n{text}")
        size += len(line) + 1 + len(text)
        entries.append({"id": gen.id, "state": str(gen.state), "start": start, "end": start + len(text)})
    table = parsed_table_text(batch)  # a constrained map's values, after the texts (their offsets hold)
    if table:
        out.append(f"\n\n{table}")
    return "".join(out), entries


# -- views -------------------------------------------------------------------------------------------


class MapView:
    """Shows a batch and keeps the display in step with it.

    Args:
        batch: The generations of the map.
        shell: The IPython shell (``None`` outside IPython).
        throttle: Least seconds between two redraws while tokens stream. Default: ``0.1``.
        router: Re-sends the final display for headless clients. Default: ``None``.
    """

    def __init__(
        self,
        batch: Batch,
        *,
        shell: Any = None,
        throttle: float = 0.1,
        router: DisplayRouter | None = None,
    ) -> None:
        self.batch = batch
        self.shell = shell
        self.throttle = throttle
        self.router = router
        self.handle: Any = None
        self.parent = current_parent(shell)
        self._lock = threading.RLock()
        self._last_draw = 0.0
        self._last_publish = 0.0
        self._ended = False

    # -- lifecycle ---------------------------------------------------------------

    def show(self) -> MapView:
        """Display the view in the current cell and start following every input."""
        self._display()
        for gen in self.batch:
            gen.add_listener(self.on_event)
        # Inputs may have moved on, or all ended, before the listeners were added.
        if outcome(self.batch) is not None:
            self._end()
        else:
            self.draw()
        return self

    def on_event(self, event: GenerationEvent) -> None:
        """The listener of every input (worker thread, or the canceller's for a queued one)."""
        if event.kind == "state" and event.state.final:
            self._input_finished()
            return
        now = time.monotonic()
        if event.kind != "state" and now - self._last_draw < self.throttle:
            return
        self._last_draw = now
        with thread_parent(self.shell, self.parent):
            self.draw()

    def _input_finished(self) -> None:
        # States, not Generation.finished: listeners hear the final state before waiters wake.
        if outcome(self.batch) is not None:
            self._end()
            return
        with thread_parent(self.shell, self.parent):
            self.draw()
        now = time.monotonic()
        if now - self._last_publish >= PUBLISH_INTERVAL_S:
            self._last_publish = now
            self.publish_final()

    def _end(self) -> None:
        with self._lock:
            if self._ended:  # the last two inputs can end on two threads at once
                return
            self._ended = True
        with thread_parent(self.shell, self.parent):
            self.draw()
        self.publish_final()
        if self.router is not None and threading.current_thread() is not threading.main_thread():
            # The router only calls publish_final(), which this view has.
            self.router.final_sent(cast(Any, self))
        for gen in self.batch:
            gen.remove_listener(self.on_event)

    # -- for subclasses --------------------------------------------------------------

    def _display(self) -> None:
        raise NotImplementedError

    def draw(self) -> None:
        """Bring the display up to date with the batch."""
        raise NotImplementedError

    def publish(self) -> None:
        """Send the whole display again with the calling thread's current parent."""
        with self._lock:
            if self.handle is not None:
                self.handle.update(self._bundle())

    def publish_final(self) -> None:
        """Send the results so far to headless clients (see the module docstring)."""
        self.publish()

    def _bundle(self) -> Bundle:
        text, entries = map_plain_text(self.batch)
        return Bundle(self._rich() | {"text/plain": text}, {MAP_METADATA_KEY: entries})

    def _rich(self) -> dict[str, Any]:
        return {}


class MapTextView(MapView):
    """A ``text/plain`` display updated in place (no widget frontend)."""

    def _display(self) -> None:
        from IPython.display import display

        self.handle = display(self._bundle(), display_id=True)

    def draw(self) -> None:
        self.publish()  # the text is the display: a redraw is a whole update

    def publish_final(self) -> None:
        # A draw already went to the starting cell; a headless client may be reading
        # another cell by now, so send it with the current parent too.
        if msg_id(current_parent(self.shell)) != msg_id(self.parent):
            self.publish()


class MapWidgetView(MapView):
    """Stop all, Pause all / Resume all, overall progress, and a row per input with its own Stop."""

    def __init__(self, batch: Batch, **kwargs: Any) -> None:
        super().__init__(batch, **kwargs)
        import ipywidgets as w

        self.stop_all = w.Button(
            description="Stop all", icon="stop", tooltip="Stop every input; the model stays loaded"
        )
        self.pause_all = w.Button(
            description="Pause all", icon="pause", tooltip="Pause every input; Resume all continues exactly"
        )
        self.progress = w.FloatProgress(
            value=0.0,
            min=0.0,
            max=1.0,
            description=f"0/{len(batch)} done",
            style={"description_width": "initial"},
            layout=w.Layout(flex="1 1 auto", min_width="12em"),
        )
        self.summary = w.HTML(value="")
        self.table = w.HTML(value="")  # the parsed values of a constrained map, filled in as inputs finish
        header = w.HBox([self.stop_all, self.pause_all, self.progress], layout=w.Layout(align_items="center"))
        self.stops: list[Any] = []
        self.lines: list[Any] = []
        rows = []
        for index, gen in enumerate(batch.generations[:MAX_ROWS]):
            stop = w.Button(
                description="Stop", icon="stop", tooltip=f"Stop input {index}", layout=w.Layout(width="auto")
            )
            stop.on_click(lambda button, gen=gen: self._on_stop_click(gen))
            line = w.HTML(value="")
            row = w.HBox([stop, line], layout=w.Layout(align_items="center"))
            row.add_class("mlxgen-map-row")
            self.stops.append(stop)
            self.lines.append(line)
            rows.append(row)
        hidden = len(batch) - len(rows)
        if hidden > 0:
            rows.append(w.HTML(value=f"<i>… and {hidden} more inputs: bind the batch with -o NAME to reach them</i>"))
        self.box = w.VBox([header, self.summary, self.table, *rows])
        self.box.add_class("mlxgen-map")
        self.stop_all.on_click(self._on_stop_all_click)
        self.pause_all.on_click(self._on_pause_all_click)
        for button in (self.stop_all, self.pause_all, *self.stops):
            keep_frontend_subshell(button)

    # -- clicks (from the frontend's comm messages) -------------------------------------

    def _on_stop_click(self, gen: Generation) -> None:
        gen.cancel()
        self.draw()

    def _on_stop_all_click(self, button: Any) -> None:
        self.batch.cancel()
        self.draw()

    def _on_pause_all_click(self, button: Any) -> None:
        if self._pause_requested():
            self.batch.resume()
        else:
            self.batch.pause()
        self.draw()

    def _pause_requested(self) -> bool:
        return any(g.token.pause_requested for g in self.batch if not g.state.final)

    # -- drawing -------------------------------------------------------------------------

    def _display(self) -> None:
        from IPython.display import display

        self.draw()
        self.handle = display(self._bundle(), display_id=True)

    def _rich(self) -> dict[str, Any]:
        return dict(self.box._repr_mimebundle_())

    def draw(self) -> None:
        batch = self.batch
        with self._lock:
            for index, (gen, stop, line) in enumerate(zip(batch, self.stops, self.lines)):
                state = gen.state
                with line.hold_sync(), stop.hold_sync():
                    stop.disabled = state.final or gen.token.cancelled
                    color = OUTCOME_COLOR.get(state, "inherit")
                    line.value = (
                        f'<span style="color: {color}" title="{html.escape(gen.text)}">'
                        f"{html.escape(row_line(index, gen))}</span>"
                    )
            self._draw_header()
            table = parsed_table_html(batch)
            if table != self.table.value:
                self.table.value = table

    def _draw_header(self) -> None:
        batch = self.batch
        end = outcome(batch)
        finished = sum(gen.state.final for gen in batch)
        live = [g for g in batch if not g.state.final and not g.token.cancelled]
        with self.summary.hold_sync(), self.progress.hold_sync(), self.stop_all.hold_sync(), self.pause_all.hold_sync():
            self.stop_all.disabled = not live
            pause = self.pause_all
            if live and self._pause_requested():
                pause.description, pause.icon, pause.disabled = "Resume all", "play", False
            else:
                pause.description, pause.icon = "Pause all", "pause"
                pause.disabled = not live
            self.progress.description = f"{finished}/{len(batch)} done"
            self.progress.value = overall_fraction(batch)
            self.progress.bar_style = OUTCOME_STYLE.get(end, "info") if end is not None else "info"
            color = OUTCOME_COLOR.get(end, "inherit") if end is not None else "inherit"
            self.summary.value = f'<span style="color: {color}; font-size: 0.9em">{html.escape(batch.summary())}</span>'


class MapTerminalView(MapView):
    """Terminal IPython: print each result as it finishes while the cell waits."""

    def __init__(self, batch: Batch, *, stream: bool = False, **kwargs: Any) -> None:
        super().__init__(batch, **kwargs)
        self.stream = stream
        self._printed: set[int] = set()

    def _display(self) -> None:
        if not self.stream:
            print(
                f"mlxgen map of {len(self.batch)} inputs runs in the background: %mlxgen_jobs shows them, "
                "%mlxgen_stop all stops them, --out NAME binds their Batch"
            )

    def draw(self) -> None:
        if not self.stream:
            return
        with self._lock:
            for index, gen in enumerate(self.batch):
                if gen.state.final and gen.id not in self._printed:
                    self._printed.add(gen.id)
                    print(f"{row_line(index, gen)}\n{gen.text}\n", flush=True)

    def publish(self) -> None:
        self.draw()

    def publish_final(self) -> None:
        self.draw()
        if self.stream:
            table = parsed_table_text(self.batch)
            print(f"[mlxgen map: {self.batch.summary()}]" + (f"\n{table}" if table else ""), flush=True)


def make_map_view(
    batch: Batch,
    *,
    shell: Any,
    ui: str = "auto",
    throttle: float = 0.1,
    router: DisplayRouter | None = None,
    waiting: bool = False,
) -> MapView:
    """The right view of ``batch`` for this shell and setting (not shown yet: call ``show()``).

    Args:
        batch: The generations of the map.
        shell: The IPython shell.
        ui: ``"auto"``, ``"widget"`` or ``"text"``. Default: ``"auto"``.
        throttle: Least seconds between redraws. Default: ``0.1``.
        router: See :class:`.widget.DisplayRouter`. Default: ``None``.
        waiting: Whether the cell blocks on it (terminal views print then). Default: ``False``.
    """
    kind = choose_ui(ui, shell)
    kwargs: dict[str, Any] = dict(shell=shell, throttle=throttle, router=router)
    if kind == "terminal":
        return MapTerminalView(batch, stream=waiting, **kwargs)
    if kind == "text":
        return MapTextView(batch, **kwargs)
    return MapWidgetView(batch, **kwargs)
