"""Many generations from one call: :func:`generate_many` and its :class:`Batch` handle.

Every prompt becomes one :class:`~mlx_notebook.generation.handle.Generation`
with the same options, on the same worker. All prompts and options are checked
before the first one is queued, so a bad input queues nothing. The worker
decides how they run (one after another, or decoded together when it
batches); a :class:`Batch` only fans the handle's calls out to its members.

Example::

    import mlx_notebook
    batch = mlx_notebook.generate_many([f"Name a river in {c}." for c in ("France", "Peru")], max_tokens=32)
    batch[1].cancel()                  # one member; batch.cancel() stops them all
    print(batch.results(timeout=120))  # texts, in prompt order (partial after a stop)
    print(batch.summary())             # "2 generations: 1 done, 1 stopped · 40 tokens"

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from .errors import InvalidArgumentError, MLXNotebookError
from .generation.constraints import EXTRA, IncompleteOutputError
from .generation.handle import Generation
from .generation.request import GenerationRequest, check_option, option_names
from .generation.states import State
from .generation.worker import Worker, default_worker


class Batch(Sequence[Generation]):
    """The handles of one :func:`generate_many` call, in prompt order.

    A sequence of :class:`~mlx_notebook.generation.handle.Generation` (``len``,
    indexing, iteration) whose controls apply to every member.

    Args:
        generations: The members, in prompt order.
    """

    def __init__(self, generations: Iterable[Generation]) -> None:
        self._generations = tuple(generations)

    def __repr__(self) -> str:
        return f"<Batch {self.summary()}>"

    # -- the sequence ----------------------------------------------------------------

    @overload
    def __getitem__(self, index: int) -> Generation: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Generation]: ...

    def __getitem__(self, index: int | slice) -> Generation | Sequence[Generation]:
        return self._generations[index]

    def __len__(self) -> int:
        return len(self._generations)

    def __iter__(self) -> Iterator[Generation]:
        return iter(self._generations)

    @property
    def generations(self) -> list[Generation]:
        """The members, in prompt order."""
        return list(self._generations)

    # -- reading -----------------------------------------------------------------------

    @property
    def states(self) -> list[State]:
        """Each member's :class:`~mlx_notebook.generation.states.State`, in prompt order."""
        return [gen.state for gen in self._generations]

    @property
    def texts(self) -> list[str]:
        """Each member's text so far (partial while running or after a stop); never raises."""
        return [gen.text for gen in self._generations]

    @property
    def finished(self) -> bool:
        """Whether every member reached ``stopped``, ``done`` or ``failed``."""
        return all(gen.finished for gen in self._generations)

    @property
    def parsed(self) -> list[Any]:
        """Each member's :attr:`~mlx_notebook.generation.handle.Generation.parsed` value, in prompt order.

        Raises:
            IncompleteOutputError: A member has no value (not finished, or ended
              before its value closed); the message names the first such member
              (:meth:`records` / :meth:`to_pandas` show every member's error instead).
        """
        values = []
        for index, gen in enumerate(self._generations):
            try:
                values.append(gen.parsed)
            except IncompleteOutputError as exc:
                raise IncompleteOutputError(f"prompts[{index}]: {exc}") from None
        return values

    def records(self) -> list[dict[str, Any]]:
        """One dict per member: the parsed value's fields (``value`` when it is not an object), ``state`` and ``error``.

        Never raises: a member with no value has its ``error`` (one line) and no fields.
        """
        rows = []
        for gen in self._generations:
            row: dict[str, Any] = {}
            error = None
            try:
                row.update(_fields(gen.parsed))
            except MLXNotebookError as exc:
                error = str(exc)
            rows.append({**row, "state": str(gen.state), "error": error})
        return rows

    def columns(self, records: list[dict[str, Any]] | None = None) -> list[str]:
        """The columns of :meth:`records`: the schema's properties first, then any others, ``state``, ``error``.

        Args:
            records: What :meth:`records` returned (read again when ``None``). Default: ``None``.
        """
        names: list[str] = []
        constraint = self._generations[0].request.constraint if self._generations else None
        if constraint is not None:
            names = constraint.fields or ([] if constraint.kind == "schema" else ["value"])
        for row in self.records() if records is None else records:
            names += [key for key in row if key not in names and key not in ("state", "error")]
        return names + ["state", "error"]

    def to_pandas(self) -> Any:
        """:meth:`records` as a pandas ``DataFrame``: one column per field, plus ``state`` and ``error``.

        Raises:
            InvalidArgumentError: pandas is not installed (the message names the extra).
        """
        try:
            import pandas
        except ImportError:
            raise InvalidArgumentError(f"batch.to_pandas() needs pandas: pip install 'mlx-notebook[{EXTRA}]'") from None
        records = self.records()
        return pandas.DataFrame(records, columns=self.columns(records))

    def summary(self) -> str:
        """One line: how many members are in each state, and their tokens.

        For example ``"3 generations: 1 done, 1 decoding, 1 queued · 57 tokens"``.
        """
        counts = Counter(self.states)
        # In State's order (queued ... failed), so the line reads the same every time.
        parts = ", ".join(f"{counts[state]} {state}" for state in State if counts[state])
        tokens = sum(gen.stats.generated_tokens for gen in self._generations)
        noun = "generation" if len(self) == 1 else "generations"
        return f"{len(self)} {noun}: {parts} · {tokens} tokens"

    # -- control -------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop every member at its next checkpoint (queued ones leave the queue)."""
        # Last first: with a queue, the members behind the running one leave it
        # before the running one stops, so the worker never starts one of them.
        for gen in reversed(self._generations):
            gen.cancel()

    stop = cancel

    def pause(self) -> None:
        """Pause every unfinished member (each keeps its KV cache)."""
        for gen in self._generations:
            gen.pause()

    def resume(self) -> None:
        """Resume every paused member exactly where it stopped."""
        for gen in self._generations:
            gen.resume()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every member finished; return whether they did within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for gen in self._generations:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not gen.wait(left):
                return False
        return True

    def results(self, timeout: float | None = None) -> list[str]:
        """Wait and return every member's text, in prompt order (partial after a stop).

        Raises:
            TimeoutError: Not all finished within ``timeout`` seconds.
            Exception: The error of the first member that failed
              (:attr:`texts` still reads every text).
        """
        if not self.wait(timeout):
            raise TimeoutError(f"after {timeout} s: {self.summary()}")
        return [gen.result(0) for gen in self._generations]


def generate_many(prompts: Iterable[str | list[int]], *, worker: Worker | None = None, **options: Any) -> Batch:
    """Start one generation per prompt, all with the same options; return their :class:`Batch` at once.

    Every prompt and option is checked before any generation is queued: a bad
    one raises and queues nothing.

    Args:
        prompts: The prompts (texts, or lists of token ids), in order; any
          iterable but a single string.
        worker: The worker to queue on. Default: :func:`~mlx_notebook.default_worker`.
        **options: The options of :func:`mlx_notebook.generate` (``model``,
          ``max_tokens``, ``temperature``...), the same for every prompt.

    Raises:
        TypeError: An unknown option.
        InvalidArgumentError: No prompts, or a bad prompt (the message names
          its index) or option.
        ModelNotFoundError: The model name resolves to nothing.
    """
    unknown = sorted(set(options) - set(option_names()))
    if unknown:
        raise TypeError(
            f"generate_many() got unknown option {unknown[0]!r}; the options are: {', '.join(option_names())}"
        )
    if isinstance(prompts, (str, bytes)):
        raise InvalidArgumentError(
            f"prompts must be a list of prompts, got one {type(prompts).__name__}; use generate() for one prompt"
        )
    if not isinstance(prompts, Iterable):
        raise InvalidArgumentError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    for name, value in options.items():
        check_option(name, value)  # once, before the prompts: their errors then name only a prompt
    requests = [GenerationRequest(prompt, **options) for prompt in prompts]
    if not requests:
        raise InvalidArgumentError("prompts is empty: give at least one prompt")
    for index, request in enumerate(requests):
        try:
            request.validate()
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"prompts[{index}]: {exc}") from None
    from .cluster.routing import submit  # a running cluster's model runs on its ranks

    worker = worker or _default_worker()
    first = submit(requests[0], worker)  # one model for all: a bad name is one error, not N
    submitted: list[Generation] = [first]
    try:
        for request in requests[1:]:
            submitted.append(submit(request, worker))
    except BaseException:
        # All or nothing (a worker shut down meanwhile, an interrupt): take back what went in.
        Batch(submitted).cancel()
        raise
    return Batch(submitted)


def _fields(value: Any) -> dict[str, Any]:
    """A parsed value as a table row: a Pydantic instance's or a dict's fields, else one ``value``."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        value = dump()
    if isinstance(value, dict):
        return dict(value)
    return {"value": value}


def _default_worker() -> Worker:
    found = default_worker()
    assert found is not None  # create=True always gives one
    return found
