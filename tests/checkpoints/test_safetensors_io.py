"""checkpoints/safetensors_io.py: the writer aligns tensor data to 8 bytes, and the safetensors
library reads what it writes."""

from __future__ import annotations

import numpy as np


def test_safetensors_writer_aligns_tensor_data_and_the_reference_reader_agrees(tmp_path):
    """The header is padded so tensor data starts at a multiple of 8 bytes (as the safetensors
    library writes it, for aligned zero-copy reads), whatever the names' lengths."""
    import ml_dtypes
    import safetensors.torch
    from prove_jax.checkpoints import safetensors_io as st
    rng = np.random.default_rng(0)
    for n in range(1, 9):  # name lengths that put the unpadded header at every offset mod 8
        arrays = {"w" * n: rng.standard_normal((3, 5)).astype(np.float32),
                  "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
                  "i": np.arange(4, dtype=np.int64).reshape(2, 2)}
        entries = [(k, v.dtype, v.shape) for k, v in arrays.items()]
        path = str(tmp_path / f"t{n}.safetensors")
        st.write_file(path, entries, iter(arrays.items()))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        assert (8 + header_len) % 8 == 0, (n, header_len)
        ref = safetensors.torch.load_file(path)
        for k, v in arrays.items():
            np.testing.assert_array_equal(ref[k].float().numpy(), v.astype(np.float32))
        for k, info in st.read_header(path).items():
            np.testing.assert_array_equal(st.read_tensor(info), arrays[k])
