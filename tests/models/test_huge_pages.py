"""The KV cache's host memory in huge pages (models/huge_pages.py): zeros of the shape and
dtype asked for, advised to the kernel where it is 2 MB or more, and the pool's own."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from shoal.models import huge_pages
from shoal.models.kv_pool import KVPool
from shoal.models.load import LoadedModel

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The system's transparent huge pages setting (the bracketed word), or None."""
    if not THP_SETTING.exists():
        return None
    words = THP_SETTING.read_text().split()
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


def eligible(tensor: torch.Tensor) -> bool:
    """Whether the kernel may back `tensor`'s mapping with huge pages (/proc/self/smaps'
    THPeligible of the mapping that holds its first byte)."""
    address = tensor.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


needs_madvise = pytest.mark.skipif(
    thp_mode() != "madvise" or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="the system gives huge pages only where asked (THP 'madvise') on Linux, not here",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 3, 64), (9000, 3, 64), (3, 1, 1)])
def test_zeros_of_the_shape_and_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and not bool(t.any())
    t[-1, -1, -1] = 2  # writable, and its own memory
    assert float(t.sum()) == 2 and not bool(huge_pages.zeros(shape, dtype).any())


class RefusingMap(mmap.mmap):
    """A mapping whose kernel has no huge pages: the advice is refused (EINVAL)."""

    def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
        raise OSError(22, "Invalid argument")


def test_a_refused_advice_leaves_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages.mmap, "mmap", RefusingMap)
    t = huge_pages.zeros((huge_pages.HUGE_PAGE // 256 + 1, 64), torch.float32)
    assert t.shape == (huge_pages.HUGE_PAGE // 256 + 1, 64) and not bool(t.any())
    t[-1, -1] = 1
    assert float(t.sum()) == 1


@needs_madvise
def test_a_big_tensor_is_advised_and_a_small_one_is_torchs() -> None:
    """Under the 'madvise' setting, memory is eligible for huge pages only where it was
    advised: the pool's big tensors are, torch.zeros' own are not."""
    big = (huge_pages.HUGE_PAGE // (3 * 64 * 2) + 1, 3, 64)  # just over 2 MB of bfloat16
    advised = huge_pages.zeros(big, torch.bfloat16)
    assert eligible(advised) and advised.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not eligible(torch.zeros(big, dtype=torch.bfloat16))
    assert not eligible(huge_pages.zeros((10, 3, 64), torch.bfloat16))


@needs_madvise
def test_the_pools_tensors_on_the_cpu_are_advised_again_after_a_release(
    tiny_model: LoadedModel,
) -> None:
    config = tiny_model.config
    row = config.num_kv_heads * config.head_dim * 2  # a slot's bytes of bfloat16
    pool = KVPool(config, huge_pages.HUGE_PAGE // row + 1, torch.bfloat16, torch.device("cpu"))
    assert all(eligible(t) for t in pool.k + pool.v)
    pool.k[0][5] = 1
    pool.release()
    pool.resume()
    assert all(eligible(t) and not bool(t.any()) for t in pool.k + pool.v)
