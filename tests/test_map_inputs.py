"""The prompts of ``%%mlxgen --map``: ``{item}``, ``{item.field}``, ``{item[key]}``, and their errors."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest

from mlx_notebook import InvalidArgumentError
from mlx_notebook.notebook.interpolate import interpolate, placeholders
from mlx_notebook.notebook.map_inputs import map_prompts

pytestmark = pytest.mark.unit

City = namedtuple("City", "name country")


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{row[name]} / {row['name']} / {row[\"name\"]}", "Ada / Ada / Ada"),
        ("{xs[0]} {xs[-1]}", "a c"),
        ("{row[tags][1]} {row[1]}", "y one"),  # digits index a list, and a dict keyed "1"
        ("{deep.d[k]} {deep.d[k][0]}", "v v"),
        ("{{row[name]}} {x[0]: 1} a[0]", "{row[name]} {x[0]: 1} a[0]"),  # the escape, code, text
    ],
)
def test_item_placeholders(template: str, expected: str) -> None:
    namespace = {
        "row": {"name": "Ada", "tags": ["x", "y"], "1": "one"},
        "xs": ["a", "b", "c"],
        "deep": SimpleNamespace(d={"k": "v"}),
    }
    assert interpolate(template, namespace) == expected
    assert placeholders("{a[b].c} {{d[0]}}") == ["a[b].c"]


def test_map_prompts_fill_each_item() -> None:
    namespace = {
        "rows": [{"name": "Peru"}, {"name": "Chile"}],
        "cities": [City("Lima", "Peru"), City("Oslo", "Norway")],
        "words": ("fox", "dog"),
        "style": "briefly",
    }
    assert map_prompts("About {item[name]}, {style}.", "rows", namespace) == [
        "About Peru, briefly.",
        "About Chile, briefly.",
    ]
    assert map_prompts("{item.name} in {item.country}", "cities", namespace) == ["Lima in Peru", "Oslo in Norway"]
    assert map_prompts("Say {item}.", "words", namespace) == ["Say fox.", "Say dog."]
    assert map_prompts("{item}", "gen", {"gen": (str(i) for i in range(3))}) == ["0", "1", "2"]


def _broken():
    yield "fine"
    raise ValueError("boom")


@pytest.mark.parametrize(
    "template, name, message",
    [
        ("{item}", "nope", "--map nope: no variable 'nope'; define the list of inputs first"),
        ("{item}", "1x", "--map needs the name of a variable that holds the inputs, got '1x'"),
        ("{item}", "number", "--map number is an int, not iterable; give a list (or any iterable) of inputs"),
        ("{item}", "empty", "--map empty is empty: nothing to generate"),
        ("{item}", "text", "--map text is a single str; give a list of inputs, e.g. text = [text]"),
        ("{item}", "broken", "--map broken: iterating it failed with ValueError: boom"),
        ("{item[nme]}", "rows", "--map rows[0]: {item[nme]} in the prompt: item has no key 'nme' (KeyError)"),
        ("{item[name]}", "mixed", "--map mixed[1]: {item[name]} in the prompt: item has no key 'name' (KeyError)"),
        ("{item.name}", "rows", "item has no attribute 'name' (AttributeError); for a dict write {item[name]}"),
        ("{item[5]}", "lists", "--map lists[0]: {item[5]} in the prompt: item has no item [5] (IndexError)"),
        ("{itme}", "rows", "--map rows[0]: unknown variable {itme} in the prompt"),
    ],
)
def test_map_prompts_errors_are_one_line(template: str, name: str, message: str) -> None:
    namespace = {
        "number": 5,
        "empty": [],
        "text": "abc",
        "broken": _broken(),
        "rows": [{"name": "Peru"}],
        "mixed": [{"name": "Peru"}, {"title": "Chile"}],
        "lists": [[1, 2]],
    }
    with pytest.raises(InvalidArgumentError) as caught:
        map_prompts(template, name, namespace)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
