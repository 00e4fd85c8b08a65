"""Where the Mosaic GPU split decode kernel's time goes (`decode_attention_mgpu.split_decode(stamps=True)`): each
program's `%globaltimer` at its start, once its first page fetch is issued (its loads of the sequence's length and
page ids are back), once that page is in, after its last page and at its end, summarized over the programs of a
call as percentiles of µs from the call's first start. Beside it, the same call unstamped under the CUPTI timer
(`decode.py`'s: L2 flushed before each call), for what the stamps themselves cost.

    OUT=dir python3 -u benchmarks/attention/split_timeline.py [--points 8192x8,32768x1] [--kinds full,sliding]
        [--configs auto,s16,n3]

A point is CONTEXTxBATCH at Beam's TP8 shape (6 query heads, 1 kv head); a config is `decode.py`'s (`auto`: the
model's blocks; `s16` 16 splits; `n3` 3 stages; ...), always on the Mosaic kernel (`g1`). GPU only (Hopper).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402

from pallas_kernels import decode_attention_mgpu as dm  # noqa: E402
from pallas_kernels import paged_attention as pa  # noqa: E402

PERCENTILES = (0, 10, 50, 90, 100)


def stamp_summary(stamps) -> dict:
    """One call's stamps `[programs, len(dm.STAMPS)]` -> the kernel's span (µs), the percentiles of each time
    column (µs from the first start) and of each program's phases (µs), over the programs that visit pages."""
    stamps = np.asarray(stamps).astype(np.int64)
    columns = [dm.STAMPS.index(name) for name in dm.STAMPS if name != "pages"]
    # %globaltimer_lo wraps every 4.3 s: differences modulo 2^32, read as signed.
    times = (stamps[:, columns] - stamps[0, 0] + 2**31) % 2**32 - 2**31
    times = (times - times[:, 0].min()) / 1e3
    pages = stamps[:, dm.STAMPS.index("pages")]
    busy = times[pages > 0]
    names = [dm.STAMPS[c] for c in columns]
    at = lambda name: busy[:, names.index(name)]  # noqa: E731
    spread = lambda a: [round(float(np.percentile(a, q)), 2) for q in PERCENTILES] if len(a) else []  # noqa: E731
    phases = dict(chain=at("fetching") - at("start"), first_page=at("first_page") - at("fetching"),
                  later_pages=at("pages_done") - at("first_page"), epilogue=at("end") - at("pages_done"),
                  program=at("end") - at("start"))
    return dict(kernel_us=round(float(times[:, -1].max()), 2), programs=len(stamps), busy_programs=len(busy),
                pages=spread(pages[pages > 0]), at={name: spread(at(name)) for name in names},
                phases={name: spread(value) for name, value in phases.items()})


def run_point(ctx: int, batch: int, kind: str, spec: str, timer, calls: int) -> dict:
    """`calls` stamped calls of the split kernel at one point, and the median CUPTI time of unstamped calls."""
    shape = decode.SHAPES["tp8"]
    window = None if kind == "full" else decode.WINDOW
    q, k_pages, v_pages, query_start, seq_lens, table, _ = decode.make_inputs(ctx, batch, shape, kind, 64, jnp.bfloat16)
    blocks = decode.make_decode_blocks(spec, batch, shape["kv_heads"], table.shape[1], 64, window)
    row_token = pa.decode_metadata(query_start, q.shape[0]).row_token

    def split(stamps: bool):
        return jax.jit(lambda q, k, v, t: dm.split_decode(
            q, k, v, row_token, seq_lens, t, window=window, softmax_scale=128**-0.5, num_splits=blocks.num_splits,
            stages=blocks.num_stages, stamps=stamps))

    stamped, plain = split(True), split(False)
    summaries = []
    for _ in range(calls):
        timer.sink = timer.flush(timer.buffer)  # as the timer does: L2 flushed before the call
        summaries.append(stamp_summary(stamped(q, k_pages, v_pages, table)[-1]))
    unstamped_us, _ = timer.time(lambda: plain(q, k_pages, v_pages, table), 7)
    stamped_us, _ = timer.time(lambda: stamped(q, k_pages, v_pages, table), 7)
    return dict(context=ctx, batch=batch, kind=kind, config=spec, num_splits=blocks.num_splits,
                stages=blocks.num_stages, cupti_us=round(unstamped_us, 2), cupti_stamped_us=round(stamped_us, 2),
                calls=summaries)


def print_point(row: dict) -> None:
    print(f"\n{row['kind']} {row['context']} x {row['batch']} {row['config']}: {row['num_splits']} splits, "
          f"{row['stages']} stages; CUPTI {row['cupti_us']} us unstamped, {row['cupti_stamped_us']} stamped")
    call = sorted(row["calls"], key=lambda c: c["kernel_us"])[len(row["calls"]) // 2]  # the median call
    print(f"  median call: span {call['kernel_us']} us, {call['busy_programs']} of {call['programs']} programs "
          f"visit pages {call['pages']}; percentiles {PERCENTILES}")
    for group in ("at", "phases"):
        for name, values in call[group].items():
            print(f"  {group:6s} {name:11s} " + " ".join(f"{v:6.2f}" for v in values))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="8192x8,32768x1,131072x1")
    parser.add_argument("--kinds", default="full")
    parser.add_argument("--configs", default="auto")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    timer = decode.CuptiTimer()
    rows = []
    for point in args.points.split(","):
        ctx, batch = map(int, point.split("x"))
        for kind in args.kinds.split(","):
            for spec in args.configs.split(","):
                spec = "g1" if spec == "auto" else spec if "g1" in spec else spec + "g1"
                row = run_point(ctx, batch, kind, spec, timer, args.calls)
                print_point(row)
                rows.append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "split-timeline.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
