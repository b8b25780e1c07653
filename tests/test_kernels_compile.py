"""Every kernel launch of the GPU engine compiles for the H200 (sm_90) on this GPU-less machine
(tests/sm90_compile.py, in a process of its own: the CPU tests run Triton's interpreter, which never
invokes the compiler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("sm90_compile.py")
ENGINE_KERNELS = {
    "_embedding_kernel", "_add_rms_norm_gemv_kernel", "_gemv_kernel", "_skinny_kernel", "_gemm_kernel",
    "_rms_norm_kernel", "_qkv_epilogue_kernel",
    "_paged_prefill_kernel", "_paged_decode_kernel", "sample_stream_kernel", "sample_bracket_kernel",
    "sample_finish_kernel", "philox_uniform_kernel", "_persistent_decode_kernel",
}  # fmt: skip


def test_engine_kernels_compile_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed"] == [], json.dumps(report["failed"], indent=1)[:3000]
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(report["compiled"]) >= ENGINE_KERNELS
    assert report["split_variants"] == {"_paged_decode_kernel": True, "_paged_prefill_kernel": True}
    assert all(report["int8_kv"].values()), report["int8_kv"]
