"""How long a GGUF file with a real-size tokenizer takes to convert, and where the time goes.

Writes a family's file (random weights, hidden 64, the family's real vocabulary:
151,936 rows for qwen2/qwen3, 131,072 for mistral), then times gguf's own reader,
our ``read_header``, transformers' metadata reading of the parsed header, and the
whole conversion into an empty cache:

    python -m benchmarks.gguf_convert --family qwen2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx_notebook  # noqa: F401  (OpenBLAS before MLX, as a user gets it)
from mlx_notebook.loading import gguf, gguf_header, gguf_model
from testkit import gguf_writer as gw


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, round(time.perf_counter() - t0, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2", choices=sorted(gw.FAMILIES))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import gguf as gguf_py

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config, weights = gw.family_weights(args.family)
        path = gw.write_family_gguf(folder / f"{args.family}.gguf", args.family, config, weights)
        for i in range(args.repeats):
            _, plain_reader_s = _timed(gguf_py.GGUFReader, path)
            info, read_header_s = _timed(gguf_header.read_header, path)
            _, metadata_s = _timed(gguf_model._transformers_metadata, info)
            _, convert_s = _timed(gguf.cached_conversion, path, folder / f"cache{i}")
            print(
                json.dumps(
                    {
                        "family": args.family,
                        "gguf_reader_s": plain_reader_s,
                        "read_header_s": read_header_s,
                        "transformers_metadata_s": metadata_s,
                        "conversion_s": convert_s,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
