"""Benchmark: the trainer's offload and onload copies against one pinned copy of the same bytes.

    python -m rltrain.bench.hostcopy                       # the 1.7B trainer's state, every kind
    python -m rltrain.bench.hostcopy --shape 4b --kinds register driver

The state is what a trainer of `--shape` parks (bf16 weights and AdamW's two bf16 moments, one
device allocation per tensor, in the order the trainer allocates them). For each way of
page-locking the host buffer (`runtime.pinned.KINDS`; torch's own `pin_memory=True` as the
reference) it measures, in GB/s, both ways:

  one copy     the whole state's bytes as one device block, one copy: the limit
  park/unpark  `HostPark` as the trainer runs it: storages that lie back to back on both sides
               copied as one (`host_park.runs`; the copies it took in brackets), the device
               allocations made afresh on each onload (the caching allocator emptied between),
               at once and one second after the memory was freed (on an H100, 2026-12-05: 91%
               of the limit at once, 99% a second later)
  per storage  the same storages, one copy each (how the trainer copied before `runs`), into
               memory written before

Each figure is the median of `--repeats` cycles after a first one (the first offload copies from
the allocation order of the model's build, not from an onload's). GPU only.

With `--after-free [GIB]` it then copies the state's bytes host -> device into a fresh block right
after GIB (default: all the GPU can spare) were written and handed back to the driver, as the
loop's onload follows the engine's release, and one second later: by a copy engine (torch's
`copy_`) and by a kernel (`rltrain.kernels.triton_copy.sm_copy`, the SMs reading the pinned
buffer over the bus). In the loop the onload runs at 51% of the limit on an H200 after a 113 GiB
release; this tells whether the copy engines are what is slow then. The loop's onload copies
by kernel with `RLTRAIN_ONLOAD_COPY=kernel` (e.g. in front of `python -m rltrain.bench.e2e`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rltrain.bench.models import QWEN3_SHAPES, qwen3_config
from rltrain.runtime.pinned import KINDS, pinned_empty
from rltrain.trainer.host_park import HostPark, Parked, _bytes

GB = 1e9


def state_sizes(shape: str) -> list[int]:
    """Element counts of the model's parameters (a meta-device build: no memory)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(qwen3_config(QWEN3_SHAPES[shape]))
    return [p.numel() for p in model.parameters()]


def _median_s(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def one_copy(host: torch.Tensor, device: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Seconds of one copy device -> host and host -> device."""
    out = _median_s(lambda: host.copy_(device, non_blocking=True), repeats)
    back = _median_s(lambda: device.copy_(host, non_blocking=True), repeats)
    return out, back


def parked(sizes: list[int], kind: str, repeats: int, dev: torch.device) -> dict[str, float]:
    """The trainer's path: seconds of park and of unpark (at once, and after a pause), of
    per-storage copies, and copy counts."""
    moments = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in sizes for _ in range(2)]
    weights = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in sizes]
    park = HostPark("cuda", pinned=kind)
    park.park([moments, weights])
    torch.cuda.empty_cache()
    park.unpark()  # (the first cycle: from the build's allocation order)
    result: dict[str, float] = {}
    layout: list[Parked] = []  # where each storage sits in the host buffer
    for variant in ("now", "pause"):
        out, back = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            park.park([moments, weights])
            out.append(time.perf_counter() - t0)  # (park waits for every copy)
            layout = list(park.parked)
            torch.cuda.empty_cache()
            if variant == "pause":
                time.sleep(1.0)
            t0 = time.perf_counter()
            park.unpark()
            torch.cuda.synchronize()
            back.append(time.perf_counter() - t0 - park.allocate_s)
        result[f"park_{variant}"], result[f"unpark_{variant}"] = statistics.median(out), statistics.median(back)
        result["copies_out"], result["copies_in"] = park.copies_out, park.copies_in
    buf = park.buffer
    assert buf is not None
    storages = [(_bytes(p.storage), p.offset) for p in layout]

    def each_out() -> None:
        for d, o in storages:
            buf[o : o + d.numel()].copy_(d, non_blocking=True)

    def each_in() -> None:
        for d, o in storages:
            d.copy_(buf[o : o + d.numel()], non_blocking=True)

    result.update(storages=len(storages), each_out=_median_s(each_out, repeats), each_in=_median_s(each_in, repeats))
    return result


def after_free(total: int, free_bytes: int, repeats: int, dev: torch.device) -> dict[str, float]:
    """Seconds of one host -> device copy of `total` bytes into a fresh block, right after
    `free_bytes` were written and handed back to the driver ("now") and one second later
    ("pause"), by a copy engine ("engine") and by a kernel ("kernel")."""
    from rltrain.kernels.triton_copy import sm_copy  # noqa: PLC0415 - Triton on CUDA

    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    warm = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    sm_copy(warm, host[: 1 << 20])  # (compiled once, outside the timing)
    del warm
    result: dict[str, float] = {}
    for via in ("engine", "kernel"):
        for when in ("now", "pause"):
            times = []
            for _ in range(repeats):
                big = torch.empty(free_bytes, dtype=torch.uint8, device=dev)
                big.fill_(1)  # its pages written, as the engine's KV cache's
                torch.cuda.synchronize()
                del big
                torch.cuda.empty_cache()  # handed back to the driver
                if when == "pause":
                    time.sleep(1.0)
                block = torch.empty(total, dtype=torch.uint8, device=dev)
                t0 = time.perf_counter()
                if via == "engine":
                    block.copy_(host, non_blocking=True)
                else:
                    sm_copy(block, host)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                del block
                torch.cuda.empty_cache()
            result[f"{via}_{when}"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.7b", choices=sorted(QWEN3_SHAPES))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--after-free",
        type=float,
        nargs="?",
        const=-1.0,
        default=None,
        metavar="GIB",
        help="then the state's onload right after GIB of device memory were freed (no value: all the GPU can "
        "spare), by a copy engine and by a kernel",
    )
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.hostcopy: needs a GPU (page-locked host memory and a copy engine)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sizes = state_sizes(a.shape)
    total = sum(sizes) * 2 * 3
    print(
        f"# bench.hostcopy: {a.shape} trainer state, {total / 2**30:.2f} GiB in {3 * len(sizes)} tensors, "
        f"{torch.cuda.get_device_name()}"
    )
    block = torch.empty(total, dtype=torch.uint8, device=dev)
    ref = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    ref_out, ref_in = one_copy(ref, block, a.repeats)
    del ref, block
    print(
        f"# limit (same run): torch pin_memory=True, one copy: d->h {total / ref_out / GB:.1f} GB/s, "
        f"h->d {total / ref_in / GB:.1f} GB/s"
    )
    print(
        "| pinned | one copy d->h | one copy h->d | park d->h [copies] | unpark h->d [copies] "
        "| unpark, 1 s after the free | per storage d->h [copies] | per storage h->d |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def cell(seconds: float, limit: float, copies: float | None = None) -> str:
        note = "" if copies is None else f" [{copies:.0f}]"
        return f"{total / seconds / GB:.1f} GB/s ({limit / seconds:.0%}){note}"

    for kind in a.kinds:
        host, block = pinned_empty(total, kind), torch.empty(total, dtype=torch.uint8, device=dev)
        out, back = one_copy(host, block, a.repeats)
        del host, block
        gc.collect()
        torch.cuda.empty_cache()
        r = parked(sizes, kind, a.repeats, dev)
        gc.collect()
        torch.cuda.empty_cache()
        cells = [
            cell(out, ref_out),
            cell(back, ref_in),
            cell(r["park_now"], ref_out, r["copies_out"]),
            cell(r["unpark_now"], ref_in, r["copies_in"]),
            cell(r["unpark_pause"], ref_in),
            cell(r["each_out"], ref_out, r["storages"]),
            cell(r["each_in"], ref_in),
        ]
        print(f"| {kind} | {' | '.join(cells)} |")
    print("(shares: of torch's pinned one copy, measured above in the same run)")
    if a.after_free is not None:
        gc.collect()
        torch.cuda.empty_cache()
        spare = torch.cuda.mem_get_info(dev)[0] - total - (2 << 30)
        free_bytes = spare if a.after_free < 0 else min(int(a.after_free * 2**30), spare)
        r = after_free(total, free_bytes, a.repeats, dev)
        print(
            f"\n| h->d of {total / 2**30:.2f} GiB into a fresh block "
            f"| right after {free_bytes / 2**30:.1f} GiB were freed | 1 s later |"
        )
        print("|---|---|---|")
        print(f"| copy engine (`copy_`) | {cell(r['engine_now'], ref_in)} | {cell(r['engine_pause'], ref_in)} |")
        print(f"| kernel (`sm_copy`) | {cell(r['kernel_now'], ref_in)} | {cell(r['kernel_pause'], ref_in)} |")
        print("(shares: of torch's pinned one copy h->d above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
