#!/usr/bin/env python3
"""Writes tests/data/fixtures/megatron_{uint16,int32}.{bin,idx}: tiny Megatron-LM indexed datasets
laid out the way megatron.core.datasets.indexed_dataset._IndexWriter writes them, re-implemented
here with numpy from the format description (independent of MoP's C++ writer). format_test.cpp
reads them back; rerun this script only when the fixtures must change.

.idx: b"MMIDIDX\\x00\\x00" | <Q version 1 | <B dtype code | <Q sequence count | <Q document count
      | int32 lengths | int64 byte pointers | int64 document indices (0, ..., sequence count)
.bin: the sequences' tokens back to back in the dataset dtype.
"""
import os
import struct

import numpy as np

DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
               np.float64: 6, np.float32: 7, np.uint16: 8}


def write_dataset(prefix, dtype, sequences, document_indices):
    with open(prefix + ".bin", "wb") as f:
        for seq in sequences:
            f.write(np.array(seq, dtype=dtype).tobytes(order="C"))
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * itemsize)])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(np.array(document_indices, dtype="<i8").tobytes(order="C"))


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    os.makedirs(out, exist_ok=True)
    # GPT-2-sized vocabulary (< 65500) → uint16, as preprocess_data.py picks. Two documents, the
    # first split into sentences (--split-sentences): document indices [0, 2, 3, 4].
    write_dataset(os.path.join(out, "megatron_uint16"), np.uint16,
                  [[15496, 11, 995, 0], [40, 716], [50256], [3666, 1438, 318, 50256]],
                  [0, 2, 3, 4])
    # Qwen-sized vocabulary (151936) → int32; documents of 1 and 2 sequences.
    write_dataset(os.path.join(out, "megatron_int32"), np.int32,
                  [[151643], [100000, 120000, 7], [151935, 0]],
                  [0, 1, 3])


if __name__ == "__main__":
    main()
