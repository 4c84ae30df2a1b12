"""Constrained-decoding libraries compared on real-size vocabularies: which one the project uses.

Usage::

    python -m benchmarks.constraint_libraries --out benchmarks/results/constraint_libraries.json

For each library (llguidance, xgrammar, outlines-core) and each real-size
tokenizer (``testkit.real_tokenizer``: Qwen3's 151,936 tokens, Llama 3's
128,256), in a fresh child process each (so memory is the library's own):

* ``setup_s``: building the library's view of the tokenizer (once per model);
* ``compile_s``: each schema of :data:`SCHEMAS`, from the JSON Schema to the first mask
  computed (llguidance compiles lazily, the others ahead), or the error it gave (the
  coverage table);
* ``mask_ms``: the time to compute one token's mask (a bitmask of the vocabulary),
  walking the tokens of a valid instance of the schema: mean, p50, p99, max;
* ``rss_mb``: the process's resident memory growth over setup plus all compiles;
* ``setup_gil_ms``: the longest the setup held the GIL (a stop waits that long);
  for llguidance also ``from_json_s`` / ``from_json_gil_ms``, its tokenizer built from
  the folder's ``tokenizer.json`` as mlx-notebook does.

Prints a table per tokenizer; the JSON keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")
TOKENIZERS = ("qwen3", "llama")

_RECORD = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"],
    "additionalProperties": False,
}
_ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "zip"],
}
_INVOICE = {
    "type": "object",
    "$defs": {"address": _ADDRESS},
    "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "status": {"enum": ["draft", "sent", "paid"]},
        "billing": {"$ref": "#/$defs/address"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string", "maxLength": 40},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["item", "qty", "price"],
            },
        },
        "paid": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["number", "status", "billing", "lines", "paid", "note"],
    "additionalProperties": False,
}
_INVOICE_VALUE = {
    "number": "INV-0042",
    "status": "paid",
    "billing": {"street": "12 Rue de la Paix", "zip": "75002"},
    "lines": [{"item": "Widget", "qty": 3, "price": 9.5}, {"item": "Gadget, large", "qty": 1, "price": 120.0}],
    "paid": True,
    "note": None,
}

# JSON Schema features, one small schema each (the coverage table), and the two walked for mask times.
SCHEMAS: dict[str, dict[str, Any]] = {
    "record": _RECORD,
    "invoice": _INVOICE,
    "enum_const": {"type": "object", "properties": {"a": {"enum": [1, "x", None]}, "b": {"const": "k"}}},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"n": {"type": "string"}}}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "ref_recursive": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    },
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 8},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
    "format_date_email": {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}, "e": {"type": "string", "format": "email"}},
    },
    "number_bounds": {"type": "number", "minimum": 0, "maximum": 1},
    "integer_bounds": {"type": "integer", "minimum": 10, "maximum": 200},
    "array_items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    "additionalProperties_schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "type_list": {"type": ["string", "null"]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if_then_else": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "if": {"properties": {"a": {"const": 1}}},
        "then": {"required": ["a"]},
    },
    "not": {"not": {"type": "string"}},
    "multipleOf": {"type": "integer", "multipleOf": 5},
}
WALKS = {"record": {"city": "Lisbon", "year": 1755}, "invoice": _INVOICE_VALUE}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _byte_decoder() -> dict[str, int]:
    from testkit.real_tokenizer import _byte_alphabet

    return {c: b for b, c in enumerate(_byte_alphabet())}


class _Library:
    """One library's setup, compile, mask and advance, behind one interface."""

    def __init__(self, name: str, hf: Any) -> None:
        self.name = name
        self.hf = hf
        self.vocab = len(hf)
        t0 = time.perf_counter()
        if name == "llguidance":
            import llguidance.hf

            self.tok = llguidance.hf.from_tokenizer(hf)
        elif name == "xgrammar":
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab)
            self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        else:
            from outlines_core import Vocabulary

            dec = _byte_decoder()
            special = set(hf.all_special_ids)
            mapping: dict[bytes, list[int]] = {}
            for text, i in hf.get_vocab().items():
                if i in special:
                    continue
                data = bytes(dec[c] for c in text) if all(c in dec for c in text) else text.encode()
                mapping.setdefault(data, []).append(i)
            self.vocabulary = Vocabulary(hf.eos_token_id, mapping)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: dict[str, Any]) -> Any:
        text = json.dumps(schema)
        if self.name == "llguidance":
            import llguidance

            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
            if is_error:
                raise ValueError(messages[0])
            return grammar
        if self.name == "xgrammar":
            # The walks are compact JSON (separators "," and ":"), as the others accept by default.
            return self.compiler.compile_json_schema(
                text, any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(text), self.vocabulary)

    def first_mask(self, compiled: Any) -> None:
        """A matcher and its first mask: llguidance builds its lexer lazily, so its compile is only done here."""
        self.walk(compiled, [])

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        """Seconds per mask along ``tokens`` (each token consumed after its mask)."""
        import numpy as np

        times: list[float] = []
        if self.name == "llguidance":
            import llguidance
            import llguidance.numpy as lnp

            m = llguidance.LLMatcher(self.tok, compiled)
            mask = lnp.allocate_token_bitmask(1, self.tok.vocab_size)
            if not tokens:
                lnp.fill_next_token_bitmask(m, mask, 0)
            for t in tokens:
                t0 = time.perf_counter()
                lnp.fill_next_token_bitmask(m, mask, 0)
                times.append(time.perf_counter() - t0)
                assert m.consume_token(t), (t, m.get_error())
        elif self.name == "xgrammar":
            import xgrammar

            m = xgrammar.GrammarMatcher(compiled)
            mask = xgrammar.allocate_token_bitmask(1, self.vocab)
            if not tokens:
                m.fill_next_token_bitmask(mask)
            for t in tokens:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(mask)
                times.append(time.perf_counter() - t0)
                assert m.accept_token(t), t
        else:
            from outlines_core import Guide

            g = Guide(compiled)
            mask = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)
            if not tokens:
                g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            for t in tokens:
                t0 = time.perf_counter()
                g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
                times.append(time.perf_counter() - t0)
                g.advance(t)
        return times


def run_one(library: str, tokenizer: str, folder: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    from benchmarks.bench import GilSampler

    base = rss_mb()
    gil = GilSampler()
    t0 = time.perf_counter()
    lib = _Library(library, hf)
    setup_gil_ms = gil.longest_ms(t0, time.perf_counter())
    out: dict[str, Any] = {"library": library, "tokenizer": tokenizer, "vocab": lib.vocab, "setup_s": lib.setup_s}
    out["setup_gil_ms"] = setup_gil_ms
    if library == "llguidance":
        # What mlx-notebook does: the model folder's tokenizer.json read directly.
        import llguidance

        t0 = time.perf_counter()
        llguidance.LLTokenizer((folder / "tokenizer.json").read_text(encoding="utf-8"), eos_token=hf.eos_token_id)
        t1 = time.perf_counter()
        out["from_json_s"], out["from_json_gil_ms"] = t1 - t0, gil.longest_ms(t0, t1)
    compiled: dict[str, Any] = {}
    compile_s: dict[str, float | str] = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            compiled[name] = lib.compile(schema)
            lib.first_mask(compiled[name])
            compile_s[name] = time.perf_counter() - t0
        except Exception as exc:  # the coverage table records what failed and why
            compile_s[name] = f"error: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
    out["compile_s"] = compile_s
    out["rss_mb"] = rss_mb() - base
    masks: dict[str, dict[str, float]] = {}
    for name, value in WALKS.items():
        if name not in compiled:
            continue
        tokens = hf.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)
        times = sorted(lib.walk(compiled[name], tokens))
        masks[name] = {
            "tokens": len(times),
            "mean_ms": 1e3 * statistics.fmean(times),
            "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "max_ms": 1e3 * times[-1],
        }
    out["mask_ms"] = masks
    gil.close()
    return out


def _fmt_compile(value: float | str) -> str:
    return f"{1e3 * value:.1f} ms" if isinstance(value, float) else "no"


def report(results: list[dict[str, Any]]) -> None:
    for tokenizer in TOKENIZERS:
        rows = [r for r in results if r["tokenizer"] == tokenizer]
        if not rows:
            continue
        print(f"\n== {tokenizer} ({rows[0]['vocab']:,} tokens) ==")
        print(f"{'':28}" + "".join(f"{r['library']:>16}" for r in rows))
        print(f"{'setup (tokenizer)':28}" + "".join(f"{r['setup_s']:>14.2f} s" for r in rows))
        print(f"{'longest GIL hold in setup':28}" + "".join(f"{r['setup_gil_ms']:>13.0f} ms" for r in rows))
        print(f"{'memory growth':28}" + "".join(f"{r['rss_mb']:>13.0f} MB" for r in rows))
        for walk in WALKS:
            for key in ("mean_ms", "p99_ms", "max_ms"):
                cells = [r["mask_ms"].get(walk, {}).get(key) for r in rows]
                print(
                    f"{'mask ' + walk + ' ' + key[:-3]:28}"
                    + "".join(f"{c:>13.3f} ms" if c is not None else f"{'-':>16}" for c in cells)
                )
        for name in SCHEMAS:
            print(f"{'compile ' + name:28}" + "".join(f"{_fmt_compile(r['compile_s'][name]):>16}" for r in rows))
        print(
            f"{'schemas compiled':28}"
            + "".join(
                f"{sum(isinstance(v, float) for v in r['compile_s'].values()):>13}/{len(SCHEMAS)}" + "  " for r in rows
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--tokenizers", default=",".join(TOKENIZERS))
    parser.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "mlx-notebook-real-tokenizers")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("LIBRARY", "TOKENIZER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from testkit.real_tokenizer import PRESETS, make_real_tokenizer

    def folder(tokenizer: str) -> Path:
        preset = PRESETS[tokenizer]
        return make_real_tokenizer(
            args.build_dir / tokenizer, vocab=preset["vocab"], n_special=preset["n_special"], style=preset["style"]
        )

    if args.one:
        library, tokenizer = args.one
        print(json.dumps(run_one(library, tokenizer, folder(tokenizer))))
        return
    results = []
    for tokenizer in args.tokenizers.split(","):
        folder(tokenizer)
        for library in args.libraries.split(","):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.constraint_libraries", "--one", library, tokenizer]
                + ["--build-dir", str(args.build_dir)],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                print(f"{library} on {tokenizer} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{library} on {tokenizer}: setup {results[-1]['setup_s']:.2f} s", file=sys.stderr)
    report(results)
    if args.out:
        args.out.write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
