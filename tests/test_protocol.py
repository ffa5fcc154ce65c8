"""DataBatch: operations, their error messages, pickling and saving."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hybridflow_lab import DataBatch


def make(n: int = 6) -> DataBatch:
    return DataBatch(
        {"ids": torch.arange(n * 3).view(n, 3), "reward": torch.arange(n, dtype=torch.float32)},
        {"prompt": [f"p{i}" for i in range(n)], "truth": [[i, i + 1] for i in range(n)]},
        {"step": 3},
    )


def test_columns_and_rows():
    batch = make()
    assert len(batch) == 6
    assert batch.keys() == ["ids", "reward", "prompt", "truth"]
    assert batch["truth"][2] == [2, 3]  # lists stay one object per row
    row = batch[4]
    assert row["prompt"] == "p4" and row["reward"].item() == 4.0
    sub = batch[torch.tensor([5, 0])]
    assert sub["prompt"].tolist() == ["p5", "p0"] and sub["ids"][0].tolist() == [15, 16, 17]
    masked = batch[np.array([True, False] * 3)]
    assert masked["reward"].tolist() == [0.0, 2.0, 4.0]
    assert len(batch[1:4]) == 3 and batch[1:4].meta == {"step": 3}


def test_size_mismatch_names_every_column():
    with pytest.raises(ValueError, match=r"ids has 4.*prompt has 3"):
        DataBatch({"ids": torch.zeros(4, 2)}, {"prompt": ["a", "b", "c"]})
    batch = make()
    with pytest.raises(ValueError, match=r"column 'x' has 2 rows but the batch has 6"):
        batch["x"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"scalar"):
        DataBatch({"s": torch.tensor(1.0)})


def test_select_pop_union():
    batch = make()
    assert batch.select("ids", "prompt").keys() == ["ids", "prompt"]
    with pytest.raises(KeyError, match=r"no column\(s\) \['nope'\]; the batch has: ids, reward, prompt, truth"):
        batch.select("nope")
    popped = batch.pop("reward")
    assert popped.keys() == ["reward"] and "reward" not in batch
    merged = batch.union(popped)
    assert set(merged.keys()) == {"ids", "reward", "prompt", "truth"}
    clash = DataBatch({"ids": torch.zeros(6, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"column 'ids' differs"):
        batch.union(clash)
    with pytest.raises(ValueError, match=r"6 and 2 rows"):
        batch.union(make(2))
    with pytest.raises(ValueError, match=r"meta key 'step' differs"):
        batch.union(DataBatch({"other": torch.zeros(6)}, meta={"step": 4}))


def test_assign_rewrites_columns_and_keeps_the_rest():
    batch = make()
    rewritten = batch.assign(DataBatch({"reward": torch.ones(6), "prompt": torch.zeros(6)}, meta={"step": 4}))
    assert torch.equal(rewritten["reward"], torch.ones(6)) and torch.equal(rewritten["prompt"], torch.zeros(6))
    assert rewritten.keys() == ["ids", "reward", "prompt", "truth"] and rewritten.meta["step"] == 4
    assert torch.equal(batch["reward"], torch.arange(6, dtype=torch.float32))  # the input batch is unchanged
    with pytest.raises(ValueError, match=r"assign of batches with 6 and 2 rows"):
        batch.assign(make(2))


def test_chunk_split_concat_round_trip():
    batch = make()
    chunks = batch.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert DataBatch.concat(chunks).equals(batch)
    assert [len(p) for p in batch.split(4)] == [4, 2]
    with pytest.raises(ValueError, match=r"6 rows cannot be split into 4 equal chunks; use pad_to_multiple"):
        batch.chunk(4)
    with pytest.raises(ValueError, match=r"part 1 has columns"):
        DataBatch.concat([batch, batch.select("ids")])


def test_concat_gathers_differing_meta_per_part():
    a = DataBatch({"x": torch.zeros(1)}, meta={"step": 1, "loss": 0.5})
    b = DataBatch({"x": torch.ones(1)}, meta={"step": 1, "loss": 0.7})
    merged = DataBatch.concat([a, b])
    assert merged.meta == {"step": 1, "loss": [0.5, 0.7]}


def test_repeat_and_reorder():
    batch = DataBatch({"x": torch.tensor([1, 2])}, {"s": ["a", "b"]})
    assert batch.repeat(2)["x"].tolist() == [1, 1, 2, 2]
    assert batch.repeat(2, interleave=False)["s"].tolist() == ["a", "b", "a", "b"]
    assert batch.reorder([1, 0])["s"].tolist() == ["b", "a"]
    with pytest.raises(ValueError, match=r"permutation"):
        batch.reorder([0, 0])


def test_pad_and_unpad():
    batch = make(5)
    padded, pad = batch.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert padded["prompt"].tolist()[5:] == ["p0", "p1", "p2"]  # copied cyclically from the start
    assert padded.unpad(pad).equals(batch)
    same, none = batch.pad_to_multiple(5)
    assert none == 0 and same is batch
    assert batch[0:0].pad_to_multiple(4)[1] == 0  # zero rows are already a multiple


def test_pickle_round_trip_keeps_dtypes_and_is_writable():
    batch = make()
    batch["half"] = torch.randn(6, 2, dtype=torch.bfloat16)
    batch["mask"] = torch.tensor([True, False] * 3)
    batch["view"] = torch.arange(12).view(6, 2)[:, 1]  # not contiguous
    restored = pickle.loads(pickle.dumps(batch, protocol=5))
    assert restored.equals(batch)
    assert restored["half"].dtype == torch.bfloat16
    restored["ids"].add_(1)  # writable, and independent of the original
    assert not torch.equal(restored["ids"], batch["ids"])


def test_pickle_ships_tensors_out_of_band():
    batch = DataBatch({"big": torch.zeros(1 << 20)})
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(data) < 2048 and sum(memoryview(b).nbytes for b in buffers) == 4 << 20


def test_save_and_load(tmp_path):
    batch = make()
    path = batch.save(tmp_path / "batch.pt")
    loaded = DataBatch.load(path)
    assert loaded.equals(batch)
    assert loaded["truth"][1] == [1, 2]
    torch.load(path, weights_only=True)  # safe format: no arbitrary pickle


def test_save_refuses_objects_that_cannot_load_safely(tmp_path):
    batch = DataBatch({"x": torch.zeros(1)}, {"obj": [object()]})
    with pytest.raises(TypeError, match=r"non-tensor column 'obj' holds a object"):
        batch.save(tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
    with pytest.raises(ValueError, match=r"not a saved DataBatch"):
        torch.save({"x": 1}, tmp_path / "other.pt")
        DataBatch.load(tmp_path / "other.pt")


def test_to_pandas_shows_text_scalars_and_shapes():
    batch = make()
    batch["long"] = torch.zeros(6, 100, dtype=torch.int64)
    frame = batch.to_pandas()
    assert list(frame.columns) == ["ids", "reward", "long", "prompt", "truth"]
    assert frame.loc[1, "prompt"] == "p1"
    assert frame.loc[1, "ids"] == [3, 4, 5]
    assert frame.loc[1, "long"] == "int64[100]"
    assert "6 rows" in batch._repr_html_()


def test_nbytes_counts_tensor_data():
    batch = DataBatch({"a": torch.zeros(4, 8), "b": torch.zeros(4, dtype=torch.int64)})
    assert batch.nbytes == 4 * 8 * 4 + 4 * 8
