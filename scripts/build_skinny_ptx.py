"""Build ``mlx_notebook/generation/skinny_matmul.ptx`` from the library's kernel source with NVRTC; no GPU needed.

    pip download --no-deps 'nvidia-cuda-nvrtc>=13,<14' -d /tmp/nvrtc && unzip -q -o /tmp/nvrtc/*.whl -d /tmp/nvrtc/x
    python3 scripts/build_skinny_ptx.py /tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13

Run it whenever ``skinny_matmul``'s source changes: the PTX's first line names
the digest of the source it was built from, the library ignores a PTX whose
digest differs (it compiles the source with NVRTC at run time instead), and
``tests/test_skinny_matmul.py`` fails until the two agree.

``compute_80``: every GPU from Ampere on runs it (the kernel's bf16 MMA needs
Ampere). NVRTC 13 writes ``.version 9.x``; the kernel uses nothing past PTX ISA
8.0, so the line is written down to 8.0 and the drivers of CUDA 12.x load it
too (a driver rejects a PTX ISA newer than its own).
"""

from __future__ import annotations

import ctypes
import re
import sys

from mlx_notebook.generation import skinny_matmul

ISA = "8.0"


def build(nvrtc_path: str) -> bytes:
    lib = ctypes.CDLL(nvrtc_path)
    prog = ctypes.c_void_p()
    src = skinny_matmul.cuda_source().encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"skinny_matmul.cu", 0, None, None) != 0:
        raise SystemExit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_80", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"NVRTC failed ({rc}):\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    text = re.sub(r"^\.version \d+\.\d+$", f".version {ISA}", ptx.value.decode(), count=1, flags=re.M)
    return (skinny_matmul._DIGEST_LINE + skinny_matmul.source_digest() + "\n" + text).encode()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    data = build(sys.argv[1])
    skinny_matmul.PTX_FILE.write_bytes(data)
    print(len(data), "bytes;", re.findall(r"\.entry (\w+)", data.decode()), "->", skinny_matmul.PTX_FILE)
