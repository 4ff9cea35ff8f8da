"""Tensor layouts and copy plans without a server: tensors are described as a
client's Map does (pb messages over a real shared-memory file in tmp_path), opened
with open_rank, and a chunk's bytes must equal, rank by rank and tensor by tensor,
``tensor.index_select(block_dim, block_ids)``, the contract in regions.py. Runs
of adjacent bytes are merged, also across tensors.

Layouts: vLLM 0.32 on CPU (one allocation; per layer ``[B, H, N, C]`` with K|V in
C, blocks first), vLLM's ``[2, B, N, H, D]`` (blocks second), blocks in the middle,
padded blocks and padded heads (strided, not contiguous)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from kvsvc.errors import InvalidRequest, RegionUnavailable
from kvsvc.layout import HandleKey, HandleKind, TensorLayout, parse_tensor
from kvsvc.server.data.copies import copy_range, plan
from kvsvc.server.data.regions import Mapping, RankMapping, open_rank
from kvsvc.v1 import kv_cache_service_pb2 as pb

EL = 2  # bf16


class Region:
    """A shared-memory file and strided bf16 views on it, described for Map."""

    def __init__(self, shm_dir: Path, name: str, nbytes: int, seed: int = 0) -> None:
        self.shm_dir, self.name, self.nbytes = shm_dir, name, nbytes
        path = shm_dir / name
        with open(path, "wb") as f:
            f.truncate(nbytes)
        self.buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        g = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8))
        self.views: list[tuple[torch.Tensor, int]] = []  # (view, block_dim)

    def add(
        self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], block_dim: int
    ) -> torch.Tensor:
        elems = self.buffer.view(torch.bfloat16)
        view = torch.as_strided(elems, shape, strides, offset // EL)
        self.views.append((view, block_dim))
        return view

    def rank(self, tp_rank: int = 0, tp_size: int = 1) -> pb.RankRegion:
        handle = pb.MemoryHandle(
            shared_memory=pb.SharedMemoryHandle(name=self.name, size_bytes=self.nbytes)
        )
        return pb.RankRegion(
            context=pb.RankContext(tp_rank=tp_rank, tp_size=tp_size, pp_size=1),
            tensors=[
                pb.KVTensor(
                    name=f"layer.{i}",
                    handle=handle,
                    offset_bytes=v.storage_offset() * EL,
                    shape=list(v.shape),
                    strides=list(v.stride()),
                    dtype=pb.DTYPE_BFLOAT16,  # type: ignore[arg-type]
                    block_dim=block_dim,
                )
                for i, (v, block_dim) in enumerate(self.views)
            ],
        )

    def expected(self, block_ids: list[int]) -> bytes:
        """The chunk bytes of this rank, by the contract."""
        idx = torch.tensor(block_ids)
        return b"".join(
            v.index_select(d, idx).contiguous().view(torch.uint8).numpy().tobytes()
            for v, d in self.views
        )


def mapping_of(shm_dir: Path, *regions: Region) -> Mapping:
    ranks = [open_rank(r.rank(i, len(regions)), i, str(shm_dir)) for i, r in enumerate(regions)]
    return Mapping.of("m-1", "ns", b"", ranks)


def read_chunk(mapping: Mapping, block_ids: list[int], cuts: int = 1) -> bytes:
    """The chunk's bytes, copied in ``cuts`` pieces (as checksum segments are)."""
    the_plan = plan(mapping, block_ids)
    size = mapping.block_bytes * len(block_ids)
    buf = bytearray(size)
    view = memoryview(buf)
    bounds = [size * i // cuts for i in range(cuts + 1)]
    for lo, hi in itertools.pairwise(bounds):
        copy_range(the_plan, view, 0, lo, hi, to_store=True)
    return bytes(buf)


def check_plan(mapping: Mapping, block_ids: list[int]) -> int:
    """The plan's runs tile the chunk in order; returns how many there are."""
    the_plan = plan(mapping, block_ids)
    pos = 0
    for _region, _offset, start, n in the_plan.ops:
        assert start == pos and n > 0
        pos += n
    assert pos == mapping.block_bytes * len(block_ids)
    assert the_plan.starts == [op[2] for op in the_plan.ops]
    return len(the_plan.ops)


# --- vLLM 0.32 on CPU: [B, H, N, C] per layer, every layer a slice of one allocation ---
B, H, N, C, LAYERS = 8, 2, 4, 16, 3
BLOCK = H * N * C * EL
LAYER = B * BLOCK


def vllm_cpu(shm_dir: Path, name: str = "vllm032", seed: int = 0) -> Region:
    r = Region(shm_dir, name, LAYERS * LAYER, seed)
    for layer in range(LAYERS):
        r.add(layer * LAYER, (B, H, N, C), (H * N * C, N * C, C, 1), 0)
    return r


def test_vllm_032_cpu_layout_runs_merge_per_group_of_adjacent_blocks(tmp_path: Path) -> None:
    region = vllm_cpu(tmp_path)
    mapping = mapping_of(tmp_path, region)
    ids = [2, 3, 4, 7]
    assert mapping.block_bytes == LAYERS * BLOCK
    assert check_plan(mapping, ids) == LAYERS * 2  # [2..4] and [7], per layer
    assert read_chunk(mapping, ids) == region.expected(ids)
    assert read_chunk(mapping, ids, cuts=7) == region.expected(ids)
    # Every block of every layer: the layers are adjacent, one run in all.
    every = list(range(B))
    assert check_plan(mapping, every) == 1
    assert read_chunk(mapping, every, cuts=5) == region.expected(every)
    mapping.close()


def test_block_order_is_the_requests_not_the_memorys(tmp_path: Path) -> None:
    region = vllm_cpu(tmp_path)
    mapping = mapping_of(tmp_path, region)
    ids = [5, 1, 2, 0]
    assert check_plan(mapping, ids) == LAYERS * 3  # [5], [1, 2], [0]
    assert read_chunk(mapping, ids, cuts=3) == region.expected(ids)
    mapping.close()


def test_writing_a_chunk_back_restores_exactly_its_blocks(tmp_path: Path) -> None:
    region = vllm_cpu(tmp_path)
    mapping = mapping_of(tmp_path, region)
    ids = [6, 1, 2]
    chunk = read_chunk(mapping, ids)
    before = region.buffer.clone()
    for v, _ in region.views:
        v[ids] = 0
    the_plan = plan(mapping, ids)
    buf = memoryview(bytearray(chunk))
    copy_range(the_plan, buf, 0, 0, len(chunk) // 2, to_store=False)
    copy_range(the_plan, buf, 0, len(chunk) // 2, len(chunk), to_store=False)
    assert torch.equal(region.buffer, before)
    mapping.close()


# --- other layouts ---
def vllm_gpu_style(shm_dir: Path) -> Region:
    """[2, B, N, H, D] per layer: K and V halves, blocks on dim 1."""
    shape = (2, B, N, H, C // 2)
    layer = math.prod(shape) * EL
    r = Region(shm_dir, "kv2", LAYERS * layer, seed=1)
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    for i in range(LAYERS):
        r.add(i * layer, shape, strides, 1)
    return r


def blocks_middle(shm_dir: Path) -> Region:
    """[H, B, N, D]: one run per head for each group of adjacent blocks."""
    shape = (H, B, N, C)
    r = Region(shm_dir, "mid", 2 * math.prod(shape) * EL, seed=2)
    strides = (B * N * C, N * C, C, 1)
    for i in range(2):
        r.add(i * math.prod(shape) * EL, shape, strides, 1)
    return r


def padded_blocks(shm_dir: Path) -> Region:
    """[B, N, C] with 64 bytes of padding after each block: blocks never merge."""
    pad = 32  # elements
    stride = N * C + pad
    r = Region(shm_dir, "pad", 2 * B * stride * EL, seed=3)
    for i in range(2):
        r.add(i * B * stride * EL, (B, N, C), (stride, C, 1), 0)
    return r


def padded_heads(shm_dir: Path) -> Region:
    """[B, H, N, C] whose heads are padded: the contiguous tail is [N, C], a run per head."""
    head = N * C + 16
    r = Region(shm_dir, "heads", B * H * head * EL, seed=4)
    r.add(0, (B, H, N, C), (H * head, head, C, 1), 0)
    return r


@pytest.mark.parametrize(
    ("make", "ids", "runs"),
    [
        (vllm_gpu_style, [1, 2, 3], LAYERS * 2),  # K and V of [1..3], per layer
        (vllm_gpu_style, [3, 1], LAYERS * 2 * 2),
        (blocks_middle, [1, 2, 3], 2 * H),
        (blocks_middle, [1, 6], 2 * H * 2),
        # Block 7 of a head ends where block 0 of the next head (or tensor) starts.
        (blocks_middle, [0, 7], 2 * H * 2 - 3),
        (padded_blocks, [1, 2, 3], 2 * 3),
        (padded_heads, [4, 5], 2 * H),
    ],
    ids=[
        "vllm-kv-first",
        "vllm-kv-first-apart",
        "middle",
        "middle-apart",
        "middle-wrap",
        "pad-blk",
        "pad-head",
    ],
)
def test_strided_layouts_copy_the_contract_bytes(tmp_path: Path, make, ids, runs) -> None:
    region = make(tmp_path)
    mapping = mapping_of(tmp_path, region)
    assert check_plan(mapping, ids) == runs
    assert read_chunk(mapping, ids) == region.expected(ids)
    assert read_chunk(mapping, ids, cuts=4) == region.expected(ids)
    mapping.close()


def test_ranks_follow_each_other_in_the_chunk(tmp_path: Path) -> None:
    first, second = vllm_cpu(tmp_path, "tp0", seed=5), vllm_cpu(tmp_path, "tp1", seed=6)
    mapping = mapping_of(tmp_path, first, second)
    ids = [0, 1, 2, 3, 4, 5, 6, 7]
    assert check_plan(mapping, ids) == 2  # one run per rank: two files never merge
    assert read_chunk(mapping, ids, cuts=3) == first.expected(ids) + second.expected(ids)
    mapping.close()


# --- TensorLayout on its own ---
def test_tensor_layout_geometry() -> None:
    t = TensorLayout(
        "l",
        HandleKey(HandleKind.SHM, "x"),
        128,
        (2, B, N, H, 8),
        (B * N * H * 8, N * H * 8, H * 8, 8, 1),
        pb.DTYPE_BFLOAT16,
        1,
    )
    assert t.elsize == 2 and t.num_blocks == B
    assert t.block_bytes == 2 * N * H * 8 * 2
    assert t.end_bytes == 128 + 2 * B * N * H * 8 * 2
    assert t.signature() == ["torch.bfloat16", 1, [2, N, H, 8]]
    # K half then V half of block 3, each N*H*8 elements long
    half = N * H * 8 * 2
    assert list(t.runs([3])) == [(128 + 3 * half, half), (128 + (B + 3) * half, half)]


def test_the_fingerprint_follows_shapes_and_dtypes_not_memory(tmp_path: Path) -> None:
    a = mapping_of(tmp_path, vllm_cpu(tmp_path, "a"))
    b = mapping_of(tmp_path, vllm_cpu(tmp_path, "b", seed=9))
    c = mapping_of(tmp_path, blocks_middle(tmp_path))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    for m in (a, b, c):
        m.close()


# --- validation: parse_tensor and open_rank ---
def tensor(**changes: object) -> pb.KVTensor:
    fields: dict[str, object] = dict(
        name="layer.0",
        handle=pb.MemoryHandle(shared_memory=pb.SharedMemoryHandle(name="f", size_bytes=LAYER)),
        offset_bytes=0,
        shape=[B, H, N, C],
        strides=[H * N * C, N * C, C, 1],
        dtype=pb.DTYPE_BFLOAT16,
        block_dim=0,
    )
    fields.update(changes)
    return pb.KVTensor(**fields)  # type: ignore[arg-type]


CTX = pb.RankContext(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, group_id="g")


def test_a_valid_tensor_parses() -> None:
    t = parse_tensor(tensor(), CTX, 0)
    shm_f = HandleKey(HandleKind.SHM, "f")
    assert (t.handle_key, t.num_blocks, t.block_bytes, t.end_bytes) == (shm_f, B, BLOCK, LAYER)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(dtype=999), "unsupported dtype"),
        (dict(shape=[], strides=[]), "shape must have 1..8 dims"),
        (dict(strides=[1, 1]), "strides has 2 entries for 4 dims"),
        (dict(shape=[B, 0, N, C]), "shape entries must be > 0"),
        (dict(strides=[H * N * C, N * C, C, 2]), "the innermost stride must be 1"),
        (dict(block_dim=4), "block_dim 4 out of range"),
        (dict(handle=pb.MemoryHandle()), "memory handle is not set"),
        (dict(offset_bytes=1), "not a multiple of the element size"),
    ],
)
def test_bad_tensors_name_the_rank_and_layer(changes: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as ei:
        parse_tensor(tensor(**changes), CTX, 2)
    assert ei.value.reason == "INVALID_ARGUMENT"
    assert "tp_rank=3 pp_rank=1 group_id='g' (ranks[2]) layer 'layer.0'" in ei.value.message
    assert ei.value.metadata["tpRank"] == "3" and ei.value.metadata["layer"] == "layer.0"
    assert ei.value.metadata["rankIndex"] == "2"


def test_a_tensor_reaching_past_its_handle_is_out_of_bounds() -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse_tensor(tensor(offset_bytes=2), CTX, 0)
    assert ei.value.reason == "TENSOR_OUT_OF_BOUNDS"
    assert ei.value.metadata["endBytes"] == str(LAYER + 2)
    assert ei.value.metadata["handleBytes"] == str(LAYER)


def rank_of(*tensors: pb.KVTensor) -> pb.RankRegion:
    return pb.RankRegion(context=CTX, tensors=list(tensors))


def test_open_rank_refuses_names_that_escape_and_files_too_small(tmp_path: Path) -> None:
    def handle(name: str, size: int = LAYER) -> pb.MemoryHandle:
        return pb.MemoryHandle(shared_memory=pb.SharedMemoryHandle(name=name, size_bytes=size))

    (tmp_path / "small").write_bytes(b"\0" * (LAYER - 1))
    with pytest.raises(RegionUnavailable) as ei:
        open_rank(rank_of(tensor(handle=handle("small"))), 0, str(tmp_path))
    assert ei.value.reason == "REGION_TOO_SMALL"
    assert ei.value.metadata["needBytes"] == str(LAYER)
    for name in ("../small", ".."):
        with pytest.raises(InvalidRequest) as ei2:
            open_rank(rank_of(tensor(handle=handle(name))), 0, str(tmp_path))
        assert ei2.value.reason == "INVALID_REGION_NAME"
    (tmp_path / "big").write_bytes(b"\0" * LAYER)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(InvalidRequest) as ei3:
        open_rank(rank_of(tensor(handle=handle("link"))), 0, str(tmp_path))
    assert ei3.value.reason == "INVALID_REGION_NAME"


def test_open_rank_refuses_tensors_that_disagree_on_blocks(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"\0" * LAYER)
    other = tensor(name="layer.1", shape=[B // 2, H, N, C])
    with pytest.raises(InvalidRequest, match="disagree on the number of blocks"):
        open_rank(rank_of(tensor(), other), 0, str(tmp_path))
    with pytest.raises(InvalidRequest, match="has no tensors"):
        open_rank(rank_of(), 0, str(tmp_path))


def test_one_file_shared_by_tensors_is_opened_once(tmp_path: Path) -> None:
    region = vllm_cpu(tmp_path)
    rank: RankMapping = open_rank(region.rank(), 0, str(tmp_path))
    assert list(rank.regions) == [HandleKey(HandleKind.SHM, "vllm032")]
    assert len(rank.tensors) == LAYERS
    rank.close()
