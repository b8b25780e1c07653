"""Rewrite a GGUF file with every float matrix in Q8_0 (blocks of 32 int8 values and an fp16 scale), as
llama.cpp's own Q8_0 files hold them; 1-D tensors (norms, biases) and the metadata are copied as they are.

    python bench/q8_0_gguf.py IN.gguf OUT.gguf

The llama.cpp peer's random-weight BF16 files (../shared/peers/llamacpp/make_random_gguf.py) become the
Q8_0 files that llama.cpp and TileInfer (which serves Q8_0 layer weights as INT8) both run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def convert(source: Path, target: Path) -> tuple[int, int]:
    """Write target from source; (matrices converted, tensors copied as they are)."""
    reader = gguf.GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header fields
        value_type = field.types[0]
        sub_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    converted = copied = 0
    for tensor in reader.tensors:
        shape = tuple(int(size) for size in reversed(tensor.shape))  # numpy order: rows first
        if tensor.tensor_type in FLOAT_TYPES and len(shape) == 2 and shape[1] % 32 == 0:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, QT.Q8_0), raw_dtype=QT.Q8_0)
            converted += 1
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            copied += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return converted, copied


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    if not args.source.is_file():
        sys.exit(f"{args.source}: no such file")
    started = time.perf_counter()
    converted, copied = convert(args.source, args.target)
    size = args.target.stat().st_size / 2**30
    print(
        f"wrote {args.target}: {converted} matrices in Q8_0, {copied} tensors as they were, {size:.2f} GiB, "
        f"{time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
