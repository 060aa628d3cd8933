"""How much a checkpoint written in a background thread slows the training threads beside it.

    python benchmarks/background_write.py            # 1.6 GB (the default model's save)

Runs a matmul loop on torch's threads alone, then beside a thread that writes and fsyncs GB
gigabytes in three ways: through the page cache at nice 0, through the page cache at nice 19, and
with O_DIRECT at nice 19 (common.write_direct in common.BackgroundWriter's thread, what a save
does). For each it prints how long the write took and how many seconds of the loop's work were
lost over a window of --window seconds that holds the whole write.
"""

import argparse
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def matmuls_per_s(seconds, a):
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        a @ a
        n += 1
    return n / (time.perf_counter() - t)


def buffered(path, data):
    with open(path, "wb") as f:
        for start in range(0, len(data), 100_000_000):
            f.write(memoryview(data[start:start + 100_000_000]))
        os.fsync(f.fileno())


def direct(path, data):
    assert common.write_direct(path, [data]), "this file system refuses O_DIRECT"
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.6, help="gigabytes to write (default 1.6)")
    p.add_argument("--window", type=float, default=60, help="seconds the loop runs beside each write (default 60)")
    p.add_argument("--path", default="background_write.bin", help="file to write (removed after)")
    args = p.parse_args()
    data = torch.randint(0, 256, (int(args.gb * 1e9),), dtype=torch.uint8).numpy()
    a = torch.randn(1024, 1024)
    alone = matmuls_per_s(10, a)
    print(f"matmul loop alone: {alone:.1f}/s ({torch.get_num_threads()} threads)")
    for name, write, nice in [("page cache", buffered, 0), ("page cache", buffered, 19), ("O_DIRECT", direct, 19)]:
        took = []

        def run():
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            t = time.perf_counter()
            write(args.path, data)
            took.append(time.perf_counter() - t)

        thread = threading.Thread(target=run)
        thread.start()
        beside = matmuls_per_s(args.window, a)
        thread.join()
        os.remove(args.path)
        inside = "" if took[0] <= args.window else f" (the write outlasted the {args.window:.0f} s window)"
        print(f"{name:10s} at nice {nice:2d}: the {args.gb} GB write took {took[0]:5.1f} s; the loop lost "
              f"{(1 - beside / alone) * args.window:5.2f} s of {args.window:.0f} s{inside}")
        time.sleep(5)


if __name__ == "__main__":
    main()
