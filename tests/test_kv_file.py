"""KV cache files (generation/kv_file.py): round trips, mlx-lm interop, stops, malformed files."""

from __future__ import annotations

import gc
import json
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

import mlx_notebook  # noqa: F401  (OpenBLAS before mlx)
from mlx_notebook.control import Cancelled, CancelToken, Pace, unpaced
from mlx_notebook.generation.chunks import with_room
from mlx_notebook.generation.kv_file import _BUFFERS, KVFileError, cache_nbytes, load, read_metadata, save
from mlx_notebook.generation.prefix_cache import capacity, restore

pytestmark = pytest.mark.unit

HEADS, DIM = 2, 64


def _kv(n: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    k = mx.random.normal((1, HEADS, n, DIM)).astype(dtype)
    v = mx.random.normal((1, HEADS, n, DIM)).astype(dtype)
    return k, v


def make_layer(kind: str, dtype: mx.Dtype = mx.float32, seed: int = 0) -> object:
    """One filled cache layer of ``kind``."""
    if kind == "kv":
        c: object = KVCache()
        c.update_and_fetch(*_kv(37, dtype, seed))  # type: ignore[attr-defined]
    elif kind.startswith("q"):
        c = QuantizedKVCache(group_size=32, bits=int(kind[1:]))
        c.update_and_fetch(*_kv(37, dtype, seed))  # type: ignore[attr-defined]
    elif kind == "rot":  # not wrapped yet: buffer larger than the tokens
        c = RotatingKVCache(max_size=64, keep=4)
        c.update_and_fetch(*_kv(20, dtype, seed))  # type: ignore[attr-defined]
        c.update_and_fetch(*_kv(1, dtype, seed + 1))  # type: ignore[attr-defined]
    elif kind == "rot-wrapped":  # wrapped: the write index went round past keep
        c = RotatingKVCache(max_size=16, keep=2)
        c.update_and_fetch(*_kv(10, dtype, seed))  # type: ignore[attr-defined]
        for j in range(11):
            c.update_and_fetch(*_kv(1, dtype, seed + 1 + j))  # type: ignore[attr-defined]
        assert c.offset > c.max_size and c._idx < c.max_size  # type: ignore[attr-defined]
    elif kind == "concat":
        c = ConcatenateKVCache()
        c.update_and_fetch(*_kv(9, dtype, seed))  # type: ignore[attr-defined]
    elif kind == "empty":
        c = KVCache()
    elif kind == "empty-q":
        c = QuantizedKVCache(group_size=64, bits=4)
    else:
        raise AssertionError(kind)
    mx.eval([a for a in _leaves(c.state) if isinstance(a, mx.array)])  # type: ignore[attr-defined]
    return c


def _leaves(state: object) -> list[object]:
    out: list[object] = []
    for x in state:  # type: ignore[attr-defined]
        out.extend(_leaves(x) if isinstance(x, (tuple, list)) else [x])
    return out


def _bits(a: mx.array) -> list[int]:
    """The array's bytes as integers (exact comparison, NaN-safe, bf16 included)."""
    return memoryview(a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize])).cast("B").tolist()  # type: ignore[arg-type]


def assert_same(a: list, b: list) -> None:
    assert [type(x) for x in a] == [type(y) for y in b]
    for x, y in zip(a, b):
        sx, sy = _leaves(x.state), _leaves(y.state)
        assert len(sx) == len(sy)
        for u, v in zip(sx, sy):
            if isinstance(u, mx.array):
                assert isinstance(v, mx.array) and u.shape == v.shape and u.dtype == v.dtype
                assert _bits(u) == _bits(v)
            else:
                assert u == v and type(u) is type(v)


KINDS = ["kv", "q4", "q8", "rot", "rot-wrapped", "concat", "empty", "empty-q"]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(tmp_path: Path, kind: str, dtype: mx.Dtype) -> None:
    cache = [make_layer(kind, dtype, seed=i) for i in range(3)]
    meta = {"mlx_notebook": json.dumps({"tokens": [1, 2, 3]}), "model": "tiny"}
    path = tmp_path / "gen.safetensors"
    n = save(path, cache, meta, unpaced())
    assert n == path.stat().st_size and n >= cache_nbytes(cache)
    assert read_metadata(path) == meta
    got, got_meta = load(path, unpaced())
    assert got_meta == meta
    assert_same(cache, got)
    assert [c.offset for c in got] == [c.offset for c in cache]  # type: ignore[attr-defined]


def test_mixed_layers_and_no_metadata(tmp_path: Path) -> None:
    cache = [make_layer(k, mx.bfloat16, seed=i) for i, k in enumerate(KINDS)]
    path = tmp_path / "mixed.safetensors"
    save(path, cache, {}, unpaced())
    got, meta = load(path, unpaced())
    assert meta == {}
    assert_same(cache, got)
    save(path, [], {"a": "b"}, unpaced())
    assert load(path, unpaced()) == ([], {"a": "b"})


def test_interop_with_mlx_lm(tmp_path: Path) -> None:
    cache = [make_layer(k, mx.bfloat16, seed=i) for i, k in enumerate(KINDS)]
    meta = {"mlx_notebook": json.dumps({"request": {"max_tokens": 5}}), "fingerprint": "abc"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save(ours, cache, meta, unpaced())
    # mlx-lm reads ours
    back, back_meta = load_prompt_cache(str(ours), return_metadata=True)
    assert back_meta == meta
    assert_same(cache, back)
    assert [c.offset for c in back] == [c.offset for c in cache]
    # we read mlx-lm's
    save_prompt_cache(str(theirs), cache, meta)
    assert read_metadata(theirs) == meta
    got, got_meta = load(theirs, unpaced())
    assert got_meta == meta
    assert_same(cache, got)
    # and what mx.load sees in both files is the same tensors
    a, b = mx.load(str(ours)), mx.load(str(theirs))
    assert sorted(a) == sorted(b) and all(_bits(a[k]) == _bits(b[k]) for k in a)


def tiny_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "intermediate_size": 192,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": 101,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(5)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("room", [0, 300], ids=["no-room", "room"])
@pytest.mark.parametrize("kind", ["kv", "q4", "q8", "rot", "rot-wrapped"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_model_continues_exactly_after_load(tmp_path: Path, kind: str, dtype: mx.Dtype, room: int) -> None:
    model = tiny_llama()
    model.set_dtype(dtype)
    n_layers = len(model.layers)
    if kind == "kv":
        cache: list = [KVCache() for _ in range(n_layers)]
    elif kind.startswith("q"):
        cache = [QuantizedKVCache(group_size=32, bits=int(kind[1:])) for _ in range(n_layers)]
    else:
        cache = [RotatingKVCache(max_size=32 if kind == "rot" else 12, keep=2) for _ in range(n_layers)]
    prompt = mx.array([[(7 * i) % 101 for i in range(9)]])
    model(prompt, cache=cache)
    for t in range(6):  # single-token steps write in place (and wrap the small rotating cache)
        mx.eval(model(mx.array([[t + 3]]), cache=cache))
    path = tmp_path / f"{kind}.safetensors"
    save(path, cache, {"k": "v"}, unpaced())
    loaded, _ = load(path, unpaced(), room=room)
    for got, want in zip(loaded, cache):
        if room and not kind.startswith("rot"):
            # Read with room after the tokens (whole KV steps): the steps below write in place.
            assert got.offset == want.offset and capacity(got) == with_room(want.offset, room)
        else:
            keys = got.keys[0] if isinstance(got.keys, tuple) else got.keys
            want_keys = want.state[0][0] if isinstance(want.state[0], tuple) else want.state[0]
            assert keys.shape == want_keys.shape
    if room and not kind.startswith("rot"):
        held = [id(layer.keys) for layer in loaded]
        restore(loaded, room, unpaced(), piece_s=0.0)  # what a resume does next: nothing to copy
        assert [id(layer.keys) for layer in loaded] == held
    step = mx.array([[42]])
    for _ in range(3):
        after = model(step, cache=loaded)
        before = model(step, cache=cache)
        mx.eval(after, before)
        assert _bits(after) == _bits(before)
        step = mx.argmax(before[:, -1:], axis=-1)
    if room and not kind.startswith("rot"):
        assert [capacity(layer) for layer in loaded] == [with_room(layer.offset - 3, room) for layer in loaded]


def test_save_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    from mlx_lm.models.cache import ArraysCache

    path = tmp_path / "x.safetensors"
    with pytest.raises(KVFileError, match="ArraysCache"):
        save(path, [ArraysCache(2)], {}, unpaced())
    for bad in ({"a.b": "x"}, {"3": "x"}, {"": "x"}, {"a": 3}):
        with pytest.raises(KVFileError, match="metadata"):
            save(path, [make_layer("kv")], bad, unpaced())  # type: ignore[arg-type]
    broken = make_layer("kv")
    broken.offset = 10_000  # type: ignore[attr-defined]
    with pytest.raises(KVFileError, match="offset"):
        save(path, [broken], {}, unpaced())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KVFileError, match="cannot be opened"):
        load(tmp_path / "missing.safetensors", unpaced())
    with pytest.raises(KVFileError, match="cannot write"):
        save(tmp_path / "no" / "such" / "folder.safetensors", [make_layer("kv")], {}, unpaced())


# -- stops -------------------------------------------------------------------------

BIG_LAYERS = 24
BIG_TOKENS = 11008  # 24 layers x 2 x (8 heads x 11008 x 128 dims) bf16 = 1.08 GB


def big_cache(layers: int = BIG_LAYERS, tokens: int = BIG_TOKENS) -> list:
    """A ~1 GB bf16 cache (values cheap to make: they only need to be there)."""
    cache = []
    for i in range(layers):
        c = KVCache()
        base = mx.arange(8 * tokens * 128, dtype=mx.float32).reshape(1, 8, tokens, 128)
        c.state = ((base * (i + 1)).astype(mx.bfloat16), (base - i).astype(mx.bfloat16), tokens)
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[list, Path]:
    cache = big_cache()
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    save(path, cache, {"model": "big"}, unpaced())
    return cache, path


def stop_at_checkpoint(budget: float, after: int) -> tuple[Pace, threading.Event, list[float]]:
    """A pace whose token is cancelled by another thread right after the ``after``-th checkpoint."""
    token = CancelToken()
    reached = threading.Event()
    count = [0]
    requested: list[float] = []

    def between() -> None:
        count[0] += 1
        if count[0] == after:
            reached.set()

    def stopper() -> None:
        if reached.wait(60):
            requested.append(time.perf_counter())
            token.cancel()

    threading.Thread(target=stopper, daemon=True).start()
    return Pace(token, budget, between=between), reached, requested


def test_stop_during_save_leaves_old_file(big: tuple[list, Path], tmp_path: Path) -> None:
    cache, _ = big
    path = tmp_path / "gen.safetensors"
    path.write_bytes(b"an older good file")
    latencies = []
    for after in (2, 5):
        pace, reached, requested = stop_at_checkpoint(0.1, after)
        with pytest.raises(Cancelled):
            save(path, cache, {"m": "x"}, pace)
        latencies.append(time.perf_counter() - requested[0])
        assert reached.is_set()
        for thread in threading.enumerate():  # the temporary file is deleted on a helper thread
            if thread.name.startswith("kv-file-cleanup"):
                thread.join(60)
        assert [p.name for p in tmp_path.iterdir()] == ["gen.safetensors"]
        assert path.read_bytes() == b"an older good file"
    # 0.1 s budget; the margin is for the 2-core CPU shared with other tests.
    assert max(latencies) < 0.3, latencies
    save(path, cache, {"m": "y"}, unpaced())  # replacing a good file leaves only the new one
    for thread in threading.enumerate():
        if thread.name.startswith("kv-file-cleanup"):
            thread.join(60)
    assert [p.name for p in tmp_path.iterdir()] == ["gen.safetensors"]
    assert read_metadata(path) == {"m": "y"}


def test_stop_during_load_frees_everything(big: tuple[list, Path]) -> None:
    cache, path = big
    gc.collect()
    baseline = mx.get_active_memory()
    latencies = []
    for after in (3, 8):
        pace, reached, requested = stop_at_checkpoint(0.1, after)
        try:
            load(path, pace)
        except Cancelled:
            latencies.append(time.perf_counter() - requested[0])
        else:
            raise AssertionError("the load finished before the stop")
        gc.collect()
        # The next tensor's buffer may still be filling on the helper thread: it is freed when that ends.
        _BUFFERS.settled(60)
        gc.collect()
        assert mx.get_active_memory() <= baseline + (1 << 20), (mx.get_active_memory(), baseline)
    assert max(latencies) < 0.3, latencies
    got, meta = load(path, unpaced())
    assert meta == {"model": "big"}
    assert all(_bits(a.keys[0, 0, :4]) == _bits(b.keys[0, 0, :4]) for a, b in zip(cache[:2], got[:2]))
    assert all(mx.array_equal(a.values, b.values).item() for a, b in zip(cache, got))


def test_pause_blocks_and_resumes_a_load(big: tuple[list, Path]) -> None:
    _, path = big
    token = CancelToken()
    paused = threading.Event()
    pace = Pace(token, 0.1, on_pause=paused.set)
    token.pause()
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(load(path, pace)), daemon=True)
    t.start()
    assert paused.wait(60)
    assert not done
    token.resume()
    t.join(120)
    assert not t.is_alive() and done and len(done[0][0]) == BIG_LAYERS  # type: ignore[index]


# -- malformed files -------------------------------------------------------------------


def _file_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _assemble(header: object, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def mutations(path: Path, rng: random.Random) -> list[tuple[str, bytes]]:
    """Mutated copies of a good file: bytes flipped, cut, and semantic lies in the header."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = _file_parts(path)
    tensors = [k for k in header if k != "__metadata__"]
    out: list[tuple[str, bytes]] = []

    def lie(what: str, edit) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        out.append((what, _assemble(h, data)))

    for _ in range(60):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(8, 8 + n)] ^= 1 << rng.randrange(8)
        out.append(("header bit flips", bytes(b)))
    for _ in range(40):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(8 + n, len(raw))] = rng.randrange(256)
        out.append(("data bytes", bytes(b)))
    for _ in range(40):
        out.append(("truncated", raw[: rng.randrange(len(raw))]))
    ints = [t for t in tensors if header[t]["shape"] == [] and header[t]["dtype"] == "I32"]
    for _ in range(20):  # offsets, keep, max_size, index, bits, group size that lie
        t = rng.choice(ints)
        at = 8 + n + header[t]["data_offsets"][0]
        value = rng.choice([-1, 0, 1, 3, 7, 31, 33, 255, 257, 2**31 - 1, -(2**31)])
        out.append(("scalar values", raw[:at] + struct.pack("<i", value) + raw[at + 4 :]))
    for value in (0, 1, 7, n - 1, n + 1, len(raw), 2**31, 2**63 - 1, 2**64 - 1, 101 << 20):
        out.append(("header length", struct.pack("<Q", value) + raw[8:]))
    out.append(("trailing bytes", raw + b"\0" * 8))
    out.append(("not json", struct.pack("<Q", 4) + b"\xff\xfe{[" + raw[12:]))
    out.append(("deep json", _assemble_raw(b"[" * 100_000 + b"]" * 100_000)))
    out.append(("json list", _assemble_raw(b"[1, 2, 3]")))
    out.append(("NaN", _assemble_raw(b'{"a": NaN}')))
    out.append(("duplicate keys", _assemble_raw(b'{"__metadata__": {}, "__metadata__": {}}')))
    for _ in range(25):
        t = rng.choice(tensors)
        dtype = rng.choice(["F8", "", "f32", "F64", "BF16", "U32", "I64", "BOOL", "C64", 3, None])
        lie("dtype", lambda h, t=t, dtype=dtype: h[t].__setitem__("dtype", dtype))
    for _ in range(25):
        t = rng.choice(tensors)
        shape = list(header[t]["shape"])
        k = rng.randrange(len(shape)) if shape else None
        choice = rng.choice(["neg", "huge", "float", "drop", "add", "str", "bool"])
        if choice == "neg" and k is not None:
            shape[k] = -shape[k] - 1
        elif choice == "huge" and k is not None:
            shape[k] = 2**62
        elif choice == "float" and k is not None:
            shape[k] = shape[k] + 0.5
        elif choice == "drop" and shape:
            shape.pop()
        elif choice == "bool":
            shape = [True] * max(1, len(shape))
        elif choice == "str":
            shape = "1,2"  # type: ignore[assignment]
        else:
            shape.append(1)
        lie("shape", lambda h, t=t, shape=shape: h[t].__setitem__("shape", shape))
    for _ in range(30):
        t, u = rng.sample(tensors, 2)
        choice = rng.choice(["swap", "overlap", "out", "neg", "reverse", "copy", "shift"])

        def edit(h, t=t, u=u, choice=choice):
            a, b = h[t]["data_offsets"]
            if choice == "swap":
                h[t]["data_offsets"], h[u]["data_offsets"] = h[u]["data_offsets"], h[t]["data_offsets"]
            elif choice == "overlap":
                h[t]["data_offsets"] = [a + 2, b + 2]
            elif choice == "out":
                h[t]["data_offsets"] = [a + len(data), b + len(data)]
            elif choice == "neg":
                h[t]["data_offsets"] = [a - 8, b - 8]
            elif choice == "reverse":
                h[t]["data_offsets"] = [b, a]
            elif choice == "copy":
                h[t]["data_offsets"] = list(h[u]["data_offsets"])
            else:
                h[t]["data_offsets"] = [a, b, 3]

        lie("offsets", edit)
    classes = [k for k in header["__metadata__"] if k.startswith("1.")]
    for name in (
        "ArraysCache",
        "BatchKVCache",
        "__import__('os')",
        "",
        "KVCache",
        "RotatingKVCache",
        "QuantizedKVCache",
        "CacheList",
        "ConcatenateKVCache",
    ):
        k = rng.choice(classes)
        lie("class", lambda h, k=k, name=name: h["__metadata__"].__setitem__(k, name))
    scalars = [k for k in header["__metadata__"] if k.startswith("2.") and k != "2.0"]
    for _ in range(40):
        k = rng.choice(scalars)
        value = rng.choice([*tensors, "scalar", "none", "string", "7.3", "", "0", "99.0"])
        choice = rng.choice(["set", "drop", "add", "sentinel", "renumber"])

        def edit(h, k=k, value=value, choice=choice):
            m = h["__metadata__"]
            if choice == "set":
                m[k] = value
            elif choice == "drop":
                del m[k]
            elif choice == "add":
                m[f"2.{len(scalars)}.0"], m[f"2.{len(scalars)}.1"] = value, "scalar"
            elif choice == "sentinel":
                m["2.0"] = "x"
            else:
                m[k.replace("2.", "2.0", 1)] = m.pop(k)

        lie("scalar list", edit)
    for _ in range(15):
        t = rng.choice(tensors)
        lie("missing tensor", lambda h, t=t: h.pop(t))
    for what, edit in [
        ("metadata not object", lambda h: h.__setitem__("__metadata__", [1])),
        ("metadata not strings", lambda h: h["__metadata__"].__setitem__("0.x", 3)),
        ("metadata unknown key", lambda h: h["__metadata__"].__setitem__("3.x", "y")),
        ("class gap", lambda h: h["__metadata__"].__setitem__("1.99", "KVCache")),
        ("tensor extra key", lambda h: h[tensors[0]].__setitem__("x", 1)),
        ("tensor not object", lambda h: h.__setitem__(tensors[0], [1])),
    ]:
        lie(what, edit)
    return out


def _assemble_raw(h: bytes) -> bytes:
    return struct.pack("<Q", len(h)) + h


def fuzz_main(folder: str, seed: int) -> dict:
    """Load every mutation; count outcomes. Anything but a valid cache or KVFileError is a failure."""
    rng = random.Random(seed)
    model = tiny_llama()
    good = Path(folder) / "good.safetensors"
    cache = []
    for i in range(len(model.layers)):
        c = [KVCache(), QuantizedKVCache(group_size=32, bits=4), RotatingKVCache(max_size=12, keep=2)][i % 3]
        cache.append(c)
    model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]), cache=cache)
    mx.eval(model(mx.array([[3]]), cache=cache))
    save(good, cache, {"m": "x"}, unpaced())
    counts = {"loaded": 0, "refused": 0}
    failures: list[str] = []
    bad = Path(folder) / "bad.safetensors"
    for what, blob in mutations(good, rng):
        bad.write_bytes(blob)
        try:
            read_metadata(bad)
            loaded, _ = load(bad, unpaced())
            mx.eval(model(mx.array([[5]]), cache=loaded))
            counts["loaded"] += 1
        except KVFileError as e:
            assert "\n" not in str(e)
            counts["refused"] += 1
        except Exception as e:
            failures.append(f"{what}: {type(e).__name__}: {e}")
    return {"counts": counts, "failures": failures, "total": counts["loaded"] + counts["refused"] + len(failures)}


def test_fuzz_malformed_files(tmp_path: Path) -> None:
    # A subprocess: were a file to reach MLX's parser and crash it, the test fails instead of the run.
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import json, test_kv_file as t; print(json.dumps(t.fuzz_main({str(tmp_path)!r}, 7)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failures"] == []
    assert result["total"] >= 300
    assert result["counts"]["refused"] >= 200 and result["counts"]["loaded"] >= 10, result["counts"]
