"""Kernel-compatibility matrix: which attention kernels read which KV layout, how exactly, how fast.

Three layouts hold the same K/V:
- virtual contiguous (the vattention idea, per-layer orders): per sequence a contiguous
  [len, Hkv, D] run of a [slots, max_len, Hkv, D] tensor in reserved virtual memory, pages
  mapped only where tokens are; kernels get strided views of it;
- virtual layer-packed (vattention's default order): one region per sequence holding every
  layer's K and V per token, [slots, max_len, layers, 2, Hkv, D]; kernels get one layer's K
  and V as strided views whose token stride is layers * 2 rows;
- paged: blocks [num_blocks, block_size, Hkv, D] in one tensor, scattered, read through
  per-sequence block tables.

For each kernel and layout the matrix says whether the kernel runs on it unmodified,
reads it in place (vmkv's CPU decode kernel: strided views or a block table, no copy),
needs a block table, runs only after gathering the KV into a dense copy (timed with the
copy), or does not run; any of these whose output is further from the fp32 reference than
the dtype's tolerance (`max_error_allowed`) reads "wrong result" instead; its largest error
against an fp32 reference; and its time per call for one decode step (one query token per
sequence) across context lengths and batch sizes. Every sequence in a cell has the same context length.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vmkv.decode_kernel import DecodeKernel, dense_plan, load_decode_kernel, paged_plan
from vmkv.drivers import DEFAULT_PAGE_SIZE, CudaDriver, HostDriver, MemoryDriver
from vmkv.kv_cache import SeqStep, StepBatch
from vmkv.paging.attention import BatchedAttention

UNMODIFIED = "runs unmodified"
IN_PLACE = "reads it in place"
BLOCK_TABLE = "needs a block table"
GATHER = "needs a gather copy"
DOES_NOT_RUN = "does not run"
NOT_INSTALLED = "not installed"
WRONG_RESULT = "wrong result"

VIRTUAL = "virtual contiguous"
PACKED = "virtual layer-packed"
PAGED = "paged"
LAYOUTS = (VIRTUAL, PACKED, PAGED)


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention: SmolLM2-135M's by default (9 query heads over 3 KV heads of 64)."""

    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    num_layers: int = 30  # the layer-packed layout's token holds every layer's K and V

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads} query heads do not group over {self.num_kv_heads} KV heads")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


# ------------------------------------------------------------------- layouts
@dataclass
class DecodeCase:
    """Random q/k/v for one cell and the fp32 reference output [B, Hq, D]."""

    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor  # [B, L, Hkv, D]
    v: torch.Tensor
    scale: float
    reference: torch.Tensor

    @classmethod
    def random(
        cls, shape: AttentionShape, batch: int, context: int, device: torch.device, seed: int
    ) -> DecodeCase:
        gen = torch.Generator().manual_seed(seed)
        h, d = shape.num_kv_heads, shape.head_dim
        q = torch.randn(batch, shape.num_q_heads, d, generator=gen).to(device, shape.dtype)
        k = torch.randn(batch, context, h, d, generator=gen).to(device, shape.dtype)
        v = torch.randn(batch, context, h, d, generator=gen).to(device, shape.dtype)
        scale = d**-0.5
        return cls(q, k, v, scale, reference_attention(q, k, v, scale))

    @property
    def lens(self) -> torch.Tensor:
        return torch.full((self.k.shape[0],), self.k.shape[1], dtype=torch.int32, device=self.k.device)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive fp32 softmax(q k^T) v with grouped query heads, independent of every kernel tested."""
    b, hq, d = q.shape
    h = k.shape[2]
    qg = q.float().view(b, h, hq // h, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale
    return torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v.float()).reshape(b, hq, d)


def max_error_allowed(dtype: torch.dtype) -> float:
    """The largest error against the fp32 reference that still counts as right: a few rounding
    steps of the inputs' precision on outputs of magnitude ~1 (bf16 steps are 2^-8 there)."""
    return 1e-4 if dtype == torch.float32 else 3e-2


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class VirtualLayout:
    """K and V as [B, max_len, Hkv, D] views over reserved virtual memory, mapped for L tokens per slot.

    A slot spans whole pages and whole blocks, so paged kernels can also read it through an
    identity block table (slot b's block i is block b * blocks_per_slot + i).
    """

    def __init__(
        self,
        case: DecodeCase,
        shape: AttentionShape,
        max_len: int,
        driver: Callable[[int], MemoryDriver],
        page_size: int,
    ) -> None:
        batch, context = case.k.shape[:2]
        tb = shape.token_bytes
        self.slot_bytes = _round_up(max_len * tb, math.lcm(page_size, shape.block_size * tb))
        pages_per_slot = -(-context * tb // page_size)
        self.driver = driver(2 * batch * pages_per_slot)
        itemsize = torch.empty((), dtype=shape.dtype).element_size()
        slot_elems = self.slot_bytes // itemsize
        h, d = shape.num_kv_heads, shape.head_dim
        self.views: list[torch.Tensor] = []
        self.blocks: list[torch.Tensor] = []
        for source in (case.k, case.v):
            res = self.driver.reserve(batch * self.slot_bytes)
            for b in range(batch):
                self.driver.map(res, b * self.slot_bytes, self.driver.alloc(pages_per_slot))
            flat = self.driver.view(res, shape.dtype, [batch * slot_elems])
            view = flat.as_strided((batch, self.slot_bytes // tb, h, d), (slot_elems, h * d, d, 1))
            view[:, :context] = source
            self.views.append(view)
            self.blocks.append(flat.view(-1, shape.block_size, h, d))
        self.tables = _identity_tables(case, shape, self.slot_bytes // (shape.block_size * tb))

    def close(self) -> None:
        self.views, self.blocks = [], []
        self.driver.close()


def _identity_tables(case: DecodeCase, shape: AttentionShape, blocks_per_slot: int) -> torch.Tensor:
    """int32 [batch, blocks of the context]: slot b's block i is block b * blocks_per_slot + i."""
    batch, context = case.k.shape[:2]
    width = -(-context // shape.block_size)
    tables = torch.arange(width) + blocks_per_slot * torch.arange(batch)[:, None]
    return tables.to(torch.int32).to(case.k.device)


class PackedLayout:
    """One layer's K and V inside layer-packed slots [B, max_len, layers, 2, Hkv, D] over reserved
    virtual memory, mapped for L tokens per slot (every layer's rows: they interleave on every
    page). The views are layer 0's; every layer's have the same strides. Paged kernels read it
    through an identity block table over blocks with the same strides."""

    def __init__(
        self,
        case: DecodeCase,
        shape: AttentionShape,
        max_len: int,
        driver: Callable[[int], MemoryDriver],
        page_size: int,
    ) -> None:
        batch, context = case.k.shape[:2]
        row = shape.token_bytes
        tb = 2 * shape.num_layers * row  # a packed token
        self.slot_bytes = _round_up(max_len * tb, math.lcm(page_size, shape.block_size * tb))
        pages_per_slot = -(-context * tb // page_size)
        self.driver = driver(batch * pages_per_slot)
        res = self.driver.reserve(batch * self.slot_bytes)
        for b in range(batch):
            self.driver.map(res, b * self.slot_bytes, self.driver.alloc(pages_per_slot))
        itemsize = torch.empty((), dtype=shape.dtype).element_size()
        slot_elems, token_elems, row_elems = self.slot_bytes // itemsize, tb // itemsize, row // itemsize
        flat = self.driver.view(res, shape.dtype, [batch * slot_elems])
        h, d, bs = shape.num_kv_heads, shape.head_dim, shape.block_size
        self.views: list[torch.Tensor] = []
        self.blocks: list[torch.Tensor] = []
        num_blocks = batch * self.slot_bytes // (bs * tb)
        for t, source in enumerate((case.k, case.v)):
            start = flat[t * row_elems :]  # V is the row after K in every token
            view = start.as_strided((batch, self.slot_bytes // tb, h, d), (slot_elems, token_elems, d, 1))
            view[:, :context] = source
            self.views.append(view)
            self.blocks.append(
                start.as_strided((num_blocks, bs, h, d), (bs * token_elems, token_elems, d, 1))
            )
        self.tables = _identity_tables(case, shape, self.slot_bytes // (bs * tb))

    def close(self) -> None:
        self.views, self.blocks = [], []
        self.driver.close()


class PagedLayout:
    """The same K/V in randomly scattered blocks of one tensor, with per-sequence block tables."""

    def __init__(self, case: DecodeCase, shape: AttentionShape, seed: int) -> None:
        batch, context, h, d = case.k.shape
        bs = shape.block_size
        width = -(-context // bs)
        order = torch.randperm(batch * width, generator=torch.Generator().manual_seed(seed))
        self.tables = order.view(batch, width).to(torch.int32).to(case.k.device)
        self.blocks = []
        for source in (case.k, case.v):
            padded = torch.zeros(batch, width * bs, h, d, dtype=source.dtype, device=source.device)
            padded[:, :context] = source
            blocks = torch.empty(batch * width, bs, h, d, dtype=source.dtype, device=source.device)
            blocks[self.tables.flatten().long()] = padded.view(batch * width, bs, h, d)
            self.blocks.append(blocks)

    def gather(self, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense [B, L, Hkv, D] copies, for kernels that cannot read a block table."""
        batch = self.tables.shape[0]
        rows = self.tables.long().flatten()
        return tuple(b.index_select(0, rows).view(batch, -1, *b.shape[2:])[:, :context] for b in self.blocks)


# ------------------------------------------------------------------- kernels
DenseCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
PagedCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], Callable[[], torch.Tensor]
]


InPlaceCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, float],
    Callable[[], torch.Tensor],
]


@dataclass(frozen=True)
class Kernel:
    """dense(q, k, v, lens, scale) reads [B, >=L, Hkv, D] views (any strides, last dim contiguous);
    paged(q, k_blocks, v_blocks, tables, lens, scale) returns the per-call closure, so that per-step
    preparation (plans, index tensors) stays outside the timed call, as in an engine step;
    in_place(q, k, v, tables or None, lens, scale) does the same for a kernel that reads either
    layout directly (tables None: k/v are the dense views)."""

    name: str
    dense: DenseCall | None = None
    paged: PagedCall | None = None
    in_place: InPlaceCall | None = None
    missing: str | None = None  # why it is not installed here


def _grouped(q: torch.Tensor, h: int) -> torch.Tensor:
    """[B, Hq, D] -> [B, Hkv, G, D]: the G query heads sharing a KV head act as G query rows."""
    b, hq, d = q.shape
    return q.view(b, h, hq // h, d)


def _sdpa(backend: SDPBackend) -> DenseCall:
    def call(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        context = int(lens.max())
        keys, values = k[:, :context].transpose(1, 2), v[:, :context].transpose(1, 2)
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(_grouped(q, k.shape[2]), keys, values, scale=scale)
        return out.reshape(q.shape)

    return call


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    context = int(lens.max())
    with warnings.catch_warnings():  # eager use is deliberate: it is what runs without a compiler
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex_attention(
            _grouped(q, k.shape[2]),
            k[:, :context].transpose(1, 2),
            v[:, :context].transpose(1, 2),
            scale=scale,
        )
    return out.reshape(q.shape)


def _flash_attn_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    slots = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1), k, v, cache_seqlens=lens, cache_batch_idx=slots, softmax_scale=scale
    )
    return out.squeeze(1)


def _flash_attn_paged(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> Callable[[], torch.Tensor]:
    from flash_attn import flash_attn_with_kvcache

    return lambda: flash_attn_with_kvcache(
        q.unsqueeze(1), k_blocks, v_blocks, cache_seqlens=lens, block_table=tables, softmax_scale=scale
    ).squeeze(1)


def _vmkv_paged_torch(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> Callable[[], torch.Tensor]:
    """The paged layout's torch path: one gather of the decode rows' blocks, then one SDPA call."""
    path = BatchedAttention(use_kernel=False)
    steps = [SeqStep(i, int(n) - 1, 1) for i, n in enumerate(lens.tolist())]
    batch = StepBatch.build(steps, q.device)
    width = [-(-int(n) // k_blocks.shape[1]) for n in lens.tolist()]
    table_lists = [row[:w] for row, w in zip(tables.tolist(), width, strict=True)]
    plan = path.plan(batch, table_lists, torch.zeros(len(steps), dtype=torch.int64, device=q.device))
    new_kv = torch.empty(len(steps), *k_blocks.shape[2:], dtype=k_blocks.dtype, device=q.device)  # unread
    return lambda: path.forward(q, new_kv, new_kv, k_blocks, v_blocks, plan, scale)


def _vmkv_cpu_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor | None,
    lens: torch.Tensor,
    scale: float,
) -> Callable[[], torch.Tensor]:
    """vmkv's CPU decode kernel (what both layouts run on a CPU): reads the views or the blocks
    in place, gathers nothing."""
    if q.device.type != "cpu":
        raise RuntimeError("the CPU decode kernel runs on the CPU only")
    kernel: DecodeKernel | None = load_decode_kernel(k.dtype, q.shape[1] // k.shape[2], k.shape[3])
    if kernel is None:
        raise RuntimeError("the CPU decode kernel could not be built here")
    q = q.contiguous()
    rows = torch.arange(q.shape[0])
    plan = dense_plan(rows, lens, rows, k) if tables is None else paged_plan(rows, lens, tables, k)
    out = torch.empty_like(q)

    def call() -> torch.Tensor:
        kernel(plan, q, k, v, out, scale)
        return out

    return call


def available_kernels(device: torch.device) -> list[Kernel]:
    """Every kernel the matrix tries; flash-attn only where it is installed."""
    kernels = [
        Kernel("sdpa math", dense=_sdpa(SDPBackend.MATH)),
        Kernel("sdpa flash", dense=_sdpa(SDPBackend.FLASH_ATTENTION)),
        Kernel("sdpa efficient", dense=_sdpa(SDPBackend.EFFICIENT_ATTENTION)),
    ]
    if device.type == "cuda":
        kernels.append(Kernel("sdpa cudnn", dense=_sdpa(SDPBackend.CUDNN_ATTENTION)))
    try:
        import flash_attn  # noqa: F401

        kernels.append(Kernel("flash-attn", dense=_flash_attn_dense, paged=_flash_attn_paged))
    except ImportError as e:
        kernels.append(Kernel("flash-attn", missing=str(e)))
    kernels += [
        Kernel("flex attention (eager)", dense=_flex),
        Kernel("vmkv paged: gather + sdpa", paged=_vmkv_paged_torch),
        Kernel("vmkv cpu decode kernel", in_place=_vmkv_cpu_kernel),
    ]
    return kernels


# -------------------------------------------------------------------- matrix
@dataclass
class MatrixCell:
    kernel: str
    layout: str
    status: str
    note: str = ""
    max_error: float | None = None
    times_ms: dict[str, float] = field(default_factory=dict)  # "B=8 L=512" -> best ms per call


@dataclass
class KernelMatrix:
    shape: AttentionShape
    device: str
    contexts: list[int]
    batches: list[int]
    cells: list[MatrixCell]

    def cell(self, kernel: str, layout: str) -> MatrixCell:
        for c in self.cells:
            if c.kernel == kernel and c.layout == layout:
                return c
        raise KeyError(f"no cell for {kernel!r} on {layout!r}")


def cell_key(batch: int, context: int) -> str:
    return f"B={batch} L={context}"


def time_call(
    fn: Callable[[], torch.Tensor], device: torch.device, min_seconds: float = 0.05, max_repeats: int = 20
) -> float:
    """Best seconds per call after one warm-up call, repeated until min_seconds have passed.

    The best, not the median: on a machine shared with other work, interference only ever
    adds time, so the fastest call is the least disturbed measurement of the kernel itself.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < min_seconds and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _plan_call(
    kernel: Kernel, layout: str, case: DecodeCase, virtual: VirtualLayout | PackedLayout, paged: PagedLayout
) -> tuple[str, Callable[[], torch.Tensor] | None]:
    """How `kernel` runs on `layout` for this case: (status, zero-argument call or None).
    virtual: the layout's virtual memory (contiguous or layer-packed) unless layout is PAGED."""
    q, lens, scale = case.q, case.lens, case.scale
    context = case.k.shape[1]
    if kernel.in_place is not None:
        if layout != PAGED:
            return IN_PLACE, kernel.in_place(q, *virtual.views, None, lens, scale)
        return BLOCK_TABLE, kernel.in_place(q, *paged.blocks, paged.tables, lens, scale)
    if layout != PAGED:
        if kernel.dense is not None:
            k, v = virtual.views
            return UNMODIFIED, lambda: kernel.dense(q, k, v, lens, scale)
        if kernel.paged is not None:
            k, v = virtual.blocks
            return BLOCK_TABLE, kernel.paged(q, k, v, virtual.tables, lens, scale)
    else:
        if kernel.paged is not None:
            k, v = paged.blocks
            return BLOCK_TABLE, kernel.paged(q, k, v, paged.tables, lens, scale)
        if kernel.dense is not None:

            def gather_then_attend() -> torch.Tensor:
                k, v = paged.gather(context)
                return kernel.dense(q, k, v, lens, scale)

            return GATHER, gather_then_attend
    return DOES_NOT_RUN, None


def _driver_factory(device: torch.device) -> tuple[Callable[[int], MemoryDriver], int]:
    """Drivers of n pages for the virtual layout, and their page size (the GPU's granularity on CUDA)."""
    if device.type == "cuda":
        probe = CudaDriver(1, device=device.index or 0)
        page_size = probe.page_size
        probe.close()
        return (lambda n: CudaDriver(n, page_size, device.index or 0)), page_size
    return (lambda n: HostDriver(n, DEFAULT_PAGE_SIZE, populate=True)), DEFAULT_PAGE_SIZE


def kernel_matrix(
    shape: AttentionShape | None = None,
    contexts: Sequence[int] = (128, 512, 2048),
    batches: Sequence[int] = (1, 8, 32),
    device: torch.device | str = "cpu",
    kernels: Sequence[Kernel] | None = None,
    min_seconds: float = 0.05,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> KernelMatrix:
    """Run every kernel on every layout over the context x batch grid."""
    shape = shape or AttentionShape()
    device = torch.device(device)
    kernels = list(kernels) if kernels is not None else available_kernels(device)
    max_len = max(contexts)
    driver, page_size = _driver_factory(device)
    cells = {
        (k.name, layout): MatrixCell(k.name, layout, NOT_INSTALLED if k.missing else "", k.missing or "")
        for k in kernels
        for layout in LAYOUTS
    }
    for batch in batches:
        for context in contexts:
            if progress:
                progress(cell_key(batch, context))
            case = DecodeCase.random(shape, batch, context, device, seed)
            virtual = VirtualLayout(case, shape, max_len, driver, page_size)
            packed = PackedLayout(case, shape, max_len, driver, page_size)
            paged = PagedLayout(case, shape, seed)
            dense = {VIRTUAL: virtual, PACKED: packed, PAGED: virtual}
            try:
                for kernel in kernels:
                    if kernel.missing:
                        continue
                    for layout in LAYOUTS:
                        _run_cell(
                            cells[kernel.name, layout],
                            kernel,
                            layout,
                            case,
                            dense[layout],
                            paged,
                            device,
                            cell_key(batch, context),
                            min_seconds,
                        )
            finally:
                virtual.close()
                packed.close()
    return KernelMatrix(shape, str(device), list(contexts), list(batches), list(cells.values()))


def _run_cell(
    cell: MatrixCell,
    kernel: Kernel,
    layout: str,
    case: DecodeCase,
    virtual: VirtualLayout | PackedLayout,
    paged: PagedLayout,
    device: torch.device,
    key: str,
    min_seconds: float,
) -> None:
    if cell.status == DOES_NOT_RUN:
        return  # failed on an earlier grid point: the reason is recorded once
    try:
        status, call = _plan_call(kernel, layout, case, virtual, paged)
        if call is None:
            cell.status = status
            return
        out = call()
        error = float((out.float() - case.reference).abs().max())
        seconds = time_call(call, device, min_seconds)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
        cell.status, cell.note = DOES_NOT_RUN, str(e).strip().splitlines()[0].split(". ")[0][:120]
        return
    cell.max_error = error if cell.max_error is None else max(cell.max_error, error)
    wrong = cell.status == WRONG_RESULT or cell.max_error > max_error_allowed(case.q.dtype)
    cell.status = WRONG_RESULT if wrong else status  # a kernel returning garbage must not read "runs"
    cell.times_ms[key] = seconds * 1e3
