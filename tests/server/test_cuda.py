"""CUDA IPC data path: an engine's KV tensors on the GPU, mapped by handle with
the device UUID, stored into the pinned chunk store and loaded back. Skipped
without a CUDA device (CI has none); run on a GPU host with `pytest tests/server/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import describe_cuda_tensors, rank_context
from kvsvc.errors import InvalidRequest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def kv_tensors(seed: int, layers: int = 4, blocks: int = 32) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(2, blocks, 16, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(layers)
    ]


def test_cuda_round_trip_is_bit_exact(spawn) -> None:
    srv = spawn("--device", "cuda")
    src, dst = kv_tensors(1), [torch.zeros_like(t) for t in kv_tensors(2)]
    torch.cuda.synchronize()
    with KVCacheClient(srv.address) as c:
        assert c.server_info().device == "cuda"
        ctx = rank_context(group_id="gpu")
        m_src = c.map("cuda-ns", [describe_cuda_tensors(src, block_dim=1, context=ctx)])
        m_dst = c.map("cuda-ns", [describe_cuda_tensors(dst, block_dim=1, context=ctx)])
        c.store(m_src, [(b"a", [0, 1, 2, 3]), (b"b", [9, 5])])
        assert c.lookup([b"a", b"b"], mapping=m_dst) == 2
        assert c.retrieve(m_dst, [(b"a", [31, 30, 29, 28]), (b"b", [7, 8])]).loaded_chunks == 2
        torch.cuda.synchronize()
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(s[:, [0, 1, 2, 3]], d[:, [31, 30, 29, 28]])
            assert torch.equal(s[:, [9, 5]], d[:, [7, 8]])
        c.unmap(m_src)
        c.unmap(m_dst)


def test_cuda_out_of_range_block_is_invalid_and_server_keeps_serving(spawn) -> None:
    srv = spawn("--device", "cuda")
    src = kv_tensors(3)
    with KVCacheClient(srv.address) as c:
        m = c.map("cuda-ns", [describe_cuda_tensors(src, block_dim=1)])
        with pytest.raises(InvalidRequest):
            c.store(m, [(b"x", [32])])
        assert c.server_info().serving


def test_cuda_chunk_is_the_same_bytes_as_a_cpu_region(spawn, shm_dir) -> None:
    """A chunk is index_select(block_dim, ids) on both devices: layouts agree."""
    from kvsvc.client.kvcache import SharedKVCache

    srv = spawn("--device", "cuda")
    gpu = kv_tensors(4, layers=2, blocks=8)
    cpu = SharedKVCache("cpu", num_layers=2, num_blocks=8, shm_dir=str(shm_dir))
    with KVCacheClient(srv.address) as c:
        m_gpu = c.map("mix", [describe_cuda_tensors(gpu, block_dim=1)])
        m_cpu = c.map("mix", [cpu.rank_region()])
        assert m_gpu.layout_fingerprint == m_cpu.layout_fingerprint
        c.store(m_gpu, [(b"k", [1, 2])])
        c.retrieve(m_cpu, [(b"k", [5, 6])])
        torch.cuda.synchronize()
        for g, h in zip(gpu, cpu.layers, strict=True):
            assert torch.equal(g[:, [1, 2]].cpu(), h[:, [5, 6]])
