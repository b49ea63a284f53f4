"""chatstore's GGUF tensor reader (model/gguf_file.py) against gguf-py's GGUFReader, the
reference implementation of the format: the same tensors (names, dims, ggml types), their data
mapped to the same shapes, dtypes and bytes, and the same architecture, on the shipped model
file. And a file that is not GGUF is refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from chatstore.model.default_model import gguf_path
from chatstore.model.gguf_file import GGUFFile


def test_same_tensors_as_gguf_py():
    from gguf import GGUFReader

    path = gguf_path()
    ours, reference = GGUFFile(path), GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data)), mine.name
    arch = reference.fields["general.architecture"]
    assert ours.architecture == bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "F32"}


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bogus)
